# PLACEHOLDER: the NGC container image is built in the launchers/container issue (#7).
# It will start from a pinned NGC PyTorch image (Transformer Engine and NVIDIA apex inside) and add
# megatron-core, vLLM built for the container's torch, nemo-run, wandb and this package with
# `pip install -e '.[gpu]'`. Until then this file only documents that plan; it builds nothing useful.
FROM scratch
