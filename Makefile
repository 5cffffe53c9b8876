# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Both create .venv if missing and install the pinned dependencies (torch first, so pip never
# swaps in a multi-GB CUDA build), plus the apt packages DeepSpeed's async_io needs when root,
# then build the JIT-compiled ops once (kernels/prebuild.py), so no run compiles on its hot path.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export WANDB_MODE ?= offline
export DS_BUILD_OPS := 0

# The kernel path a bound between two computation orders depends on, printed beside each suite's duration.
KERNEL_PATH := $(PY) -c "import torch; print(f'torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} intra-op threads')"

.PHONY: run test test-slow install apt clean

# The main job: a colocated RL run of the tiny model on CPU (experiment=cpu_demo, a few minutes).
# Each `make run` writes a new run directory under runs/; continue one with
#   $(PY) -m rl.train run_dir=runs/<dir> resume=true
run: apt $(STAMP)
	$(PY) -m rl.train run_dir=runs/cpu_demo-$$(date +%Y%m%d-%H%M%S)

# The suite without the tests marked slow (about 15 minutes alone on a 2-core host); `make test-slow` runs
# those (multi-process runs, kills, the benchmarks' quick runs: about 14 more), then the tests marked
# numerics again under the CPU kernel paths other hosts take (tools/numerics_paths.sh: ~12 more); CI runs
# both. Each prints its duration and this host's kernel path.
test: apt $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -m "not slow" --durations=20; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s, exit $$rc ($$($(KERNEL_PATH)))"; exit $$rc

test-slow: apt $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -m slow --durations=10; rc=$$?; \
	  bash tools/numerics_paths.sh $(PY); paths=$$?; [ $$rc = 0 ] && rc=$$paths; \
	  echo "make test-slow: $$(( $$(date +%s) - start )) s, exit $$rc ($$($(KERNEL_PATH)))"; exit $$rc

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory apt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (Python 3.11 is required: megatron-core 0.16.1 and the CPU torch wheel are cp311)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	printf 'torch==2.13.0\n' > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	$(PY) -c "import torch, megatron.core, deepspeed, triton, hydra, wandb, transformers; print('installed torch', torch.__version__)"
	@echo "building the JIT ops once (fused CPU kernels, DeepSpeed async_io + cpu_adam; ~4 min the first time, cached in .cache/)"
	$(PY) -m kernels.prebuild
	touch $(STAMP)

# libaio-dev: DeepSpeed's async_io (NVMe tensor store) links against it. g++: JIT-built C++ ops (kernels/cpu/). bubblewrap: the
# sandbox of model-written code (rl/envs/tools/bwrap.py). Installed only when root and missing; otherwise say what to do instead of
# failing later with an obscure error.
apt:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing bubblewrap (the sandbox of model-written code)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	else echo "warning: bubblewrap is missing and we are not root: run 'sudo apt-get install bubblewrap'; tasks that run model code refuse to start"; fi
	@if dpkg -s libaio-dev >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing libaio-dev (DeepSpeed async_io)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; \
	else echo "warning: libaio-dev is missing and we are not root: run 'sudo apt-get install libaio-dev' for NVMe offload"; fi
	@if command -v g++ >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing g++ (fused CPU kernels, DeepSpeed ops)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; \
	else echo "warning: g++ is missing and we are not root: the fused CPU kernels fall back to impl=naive"; fi
	@if command -v shellcheck >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing shellcheck (tests/tools/test_gpu_check.py lints tools/gpu_check.sh)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null || \
		echo "warning: shellcheck could not be installed: its test is skipped"; \
	else echo "warning: shellcheck is missing and we are not root: tools/gpu_check.sh is checked with bash -n only"; fi

clean:
	rm -rf $(VENV) .cache outputs runs
