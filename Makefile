# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv if needed and install torch==2.13.0 *first* so pip never resolves an
# unpinned torch (which would pull several GB of CUDA wheels on a CPU machine).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

# The other end of the supported megatron-core range (setup.py admits 0.16.x - 0.19.x; .venv
# gets the newest pip picks for this Python, 0.16.1 on 3.10/3.11): megatron-core 0.19.2 in a
# second venv. 0.17+ declares Requires-Python >= 3.12; on an older Python it is installed
# with --ignore-requires-python --no-deps plus its runtime deps (numpy, packaging) by hand.
# `import megatron.core` imports triton (megatron/core/transformer/moe/ops/paged_stash.py)
# even on CPU. A constraints file keeps pip from swapping megatron-core when it installs us.
MCORE_LATEST ?= 0.19.2
TRITON_SPEC ?= triton==3.9.0
VENV_LATEST := .venv-mcore019
BIN_LATEST := $(VENV_LATEST)/bin

.PHONY: install install-megatron-latest test test-fast test-gpu test-megatron-latest demo plan lint bench clean gpu-wheels

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,viz]"
	touch $@

install: $(BIN)/.installed

$(BIN_LATEST)/.installed: setup.py
	test -x $(BIN_LATEST)/python || $(PYTHON) -m venv $(VENV_LATEST)
	$(BIN_LATEST)/pip install -q --upgrade pip
	$(BIN_LATEST)/pip install -q "$(TORCH_SPEC)"
	if $(BIN_LATEST)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  $(BIN_LATEST)/pip install -q "megatron-core==$(MCORE_LATEST)"; \
	else \
	  $(BIN_LATEST)/pip install -q --ignore-requires-python --no-deps "megatron-core==$(MCORE_LATEST)" && \
	  $(BIN_LATEST)/pip install -q numpy "packaging>=24.2"; \
	fi
	$(BIN_LATEST)/pip install -q "$(TRITON_SPEC)"
	echo "megatron-core==$(MCORE_LATEST)" > $(VENV_LATEST)/constraints.txt
	$(BIN_LATEST)/pip install -q -c $(VENV_LATEST)/constraints.txt -e ".[test,viz]"
	touch $@

install-megatron-latest: $(BIN_LATEST)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The second pytest run forces the CUDA-safe start method (forkserver) on whole functional
# files, so the path every GPU machine takes cannot rot on this CPU-only CI.
FORKSERVER_TESTS := tests/functional/test_bridge.py tests/functional/test_testing_kit.py
test: install lint
	$(BIN)/python -m pytest -q --durations=15 tests
	MP_BRIDGE_START_METHOD=forkserver $(BIN)/python -m pytest -q $(FORKSERVER_TESTS)

# The functional suite on this machine's GPUs: NCCL under torchrun with one rank per GPU
# when there are at least 8, else the one-GPU mode (gloo ranks, every tensor on cuda:0).
test-gpu: install
	@ngpu=$$($(BIN)/python -c "import torch; print(torch.cuda.device_count())"); \
	if [ "$$ngpu" -ge 8 ]; then \
	  echo "make test-gpu: $$ngpu GPUs: NCCL, torchrun --nproc-per-node 8"; \
	  MP_BRIDGE_BACKEND=nccl $(BIN)/torchrun --nproc-per-node 8 -m pytest -q tests/functional; \
	elif [ "$$ngpu" -ge 1 ]; then \
	  echo "make test-gpu: $$ngpu GPU(s): the one-GPU mode (MP_BRIDGE_TEST_DEVICE=cuda)"; \
	  MP_BRIDGE_TEST_DEVICE=cuda $(BIN)/python -m pytest -q tests/functional; \
	else \
	  echo "make test-gpu: no CUDA device on this machine; nothing was run"; \
	fi

# The quick loop while editing (about a minute on a quiet 2-core machine): every unit test,
# 20 hypothesis examples per property, plus one functional case per wing (bridge, route,
# partition, losses). The model oracles take ~20 s a case, so they wait for `make test`
# (lint + the whole suite, what CI runs), which you run before pushing.
SMOKE := \
  "tests/functional/test_bridge.py::test_bridge_layout_of_eight_ranks[fan_in_k4_cp2]" \
  "tests/functional/test_route.py::test_route_on_eight_ranks[fan_in_cp2-nosp-plain]" \
  "tests/functional/test_partition.py::test_partition_cp2_sp_tp2_against_literal_token_lists" \
  "tests/functional/test_losses.py::test_cross_entropy_fp32"

test-fast: install
	MP_BRIDGE_FAST=1 $(BIN)/python -m pytest -q -x tests/unit $(SMOKE)

# Against megatron-core $(MCORE_LATEST): every unit test plus the functional files that run
# megatron-core code (HyperCommGrid groups, its parallel linears in every model oracle, the
# MimoModel integration, which skips on 0.16). The rest of the functional suite runs only
# torch.distributed and our code, identical under either version, so `make test` covers it
# once; running it twice would put CI past its 15-minute budget.
MCORE_TESTS := \
  tests/functional/test_megatron_mimo.py tests/functional/test_make_grid.py \
  tests/functional/test_mimo_groups.py tests/functional/test_models_oracle.py \
  tests/functional/test_models_oracle_routed.py tests/functional/test_models_oracle_pipeline.py \
  tests/functional/test_pipeline_llm_oracle.py tests/functional/test_losses.py \
  tests/functional/test_vocab_layers.py tests/functional/test_param_shards_tp4.py \
  tests/functional/test_megatron_sharded_state.py
# The hypothesis properties ran at full count in `make test`; here they rerun at 20 examples
# each (the fast profile) for what the version changes. The unit tests that run no megatron
# code and cost the most run once, in `make test`: the GPU runbook's CPU smoke and its
# kernels stage, the Triton compile facts for sm_90 (Triton alone) and the attention
# kernels' 16k-token memory caps (torch alone). That keeps CI near its 20-minute budget.
MCORE_SKIP := \
  --ignore tests/unit/test_gpu_check.py --ignore tests/unit/test_triton_compile.py \
  --deselect tests/unit/test_fold_stats.py::test_the_kernel_compiles_for_sm90_without_spills \
  --deselect tests/unit/test_attention_blocks.py::test_16k_tokens_one_process_under_a_3_gib_address_space \
  --deselect tests/unit/test_attention_blocks.py::test_16k_image_tokens_under_a_3_gib_address_space
test-megatron-latest: install-megatron-latest
	$(BIN_LATEST)/python -W ignore -c "from importlib.metadata import version as v; \
	  assert v('megatron-core') == '$(MCORE_LATEST)', v('megatron-core'); import megatron.core"
	MP_BRIDGE_FAST=1 $(BIN_LATEST)/python -m pytest -q tests/unit $(MCORE_TESTS) $(MCORE_SKIP)

demo: install
	$(BIN)/mp-bridge demo

plan: install
	$(BIN)/mp-bridge plan --world 8 --encoder tp=2,dp=4 --llm tp=2,cp=2,dp=2

bench: install
	$(BIN)/python bench/bridge.py
	$(BIN)/python bench/lm_head.py

# Wheels for the GPU runbook (bench/gpu_check.py), which installs them offline on the device
# machine (Python 3.12, torch and triton already there: never downloaded here). megatron-core
# ships a cp312 manylinux wheel (a C++ helper); the others are pure Python. The folder is
# git-ignored: the device call names it in `carry`, and the working tree plus it must stay
# under the device tool's 64 MiB.
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_SPECS ?= megatron-core==$(MCORE_LATEST) liger-kernel==0.8.5 cut-cross-entropy==25.1.1 einops==0.8.2
GPU_CARRY_LIMIT_MIB := 64

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	$(PYTHON) -m pip wheel -q --no-deps -w $(GPU_WHEELS) .
	ls -l $(GPU_WHEELS)
	@wheels=$$(du -cb $(GPU_WHEELS)/*.whl | tail -1 | cut -f1); \
	tree=$$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null \
	  | grep total$$ | cut -f1 | paste -sd+ | bc); \
	echo "wheels $$((wheels / 1024)) KiB + working tree $$((tree / 1024)) KiB = \
	$$(((wheels + tree) / 1048576)) MiB (device carry limit $(GPU_CARRY_LIMIT_MIB) MiB)"; \
	test $$((wheels + tree)) -lt $$(($(GPU_CARRY_LIMIT_MIB) * 1048576))

clean:
	rm -rf $(VENV) $(VENV_LATEST) *.egg-info .pytest_cache
