# Every install step lives here. TORCH pins the PyTorch build; on a CUDA machine use e.g.
#   make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup eval trajectories test test-fast test-realmodel

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e ".[test]"
	$(VENV)/bin/python -m treegraft_dist.models.compact
	touch $(STAMP)

setup: $(STAMP)

# The main job on the embedded default pair, on CPU, in the precision the CPU runs fastest (bf16 where it
# is native): two prompts of each of the six benchmarks, 64 new tokens, plain decoding against all-small,
# all-mid, treegraft at its fitted budget and sized every round (its scheduler fitted for this machine on first
# use) and the two Hugging Face peers.
# value-planner and oracle: add them to EVAL_METHODS.
EVAL_METHODS ?= ar,all-small,all-mid,treegraft,treegraft@sized,hf-assisted,hf-pld
# The job ends within 20 minutes from a fresh clone: setting up .venv takes about 2, the evaluation gets
# EVAL_TIME_LIMIT (models, measurements and the scheduler's fit included). On a box too slow for every method
# it leaves out all-small, all-mid and treegraft@sized for the last prompts, and the last prompts if need be,
# and says so under the summary table. EVAL_TIME_LIMIT= runs without a limit.
EVAL_TIME_LIMIT ?= 18m
eval: $(STAMP)
	$(VENV)/bin/treegraft eval --device cpu --prompts-per-benchmark 2 --max-new-tokens 64 \
		--methods $(EVAL_METHODS) --out out/eval $(if $(EVAL_TIME_LIMIT),--time-limit $(EVAL_TIME_LIMIT))

# Rebuild the scheduler trajectories that ship for the embedded pair (Ray Data, resumable; bf16 where the
# CPU runs it natively): every round of 40 prompts under all 32 schedules at every candidate budget. They
# hold no device costs that matter: each machine fits its own scheduler from them on first use.
# Two sets, at the published tree width (K = 10) and at K = 4: the fit keeps the width the device decodes fastest.
TRAJECTORIES := treegraft_dist/data/trajectories/qwen2.5-coder-1.5b+0.5b-instruct
trajectories: $(STAMP)
	$(VENV)/bin/treegraft collect --device cpu --prompts-per-benchmark 8 --max-new-tokens 48 --out $(TRAJECTORIES)
	$(VENV)/bin/treegraft collect --device cpu --tree-k 4 --prompts-per-benchmark 8 --max-new-tokens 48 \
		--out $(TRAJECTORIES)-k4

# Fast suite, then the end-to-end integration tests (whole commands on a real Ray cluster), then the
# real-model smoke test (prepares the embedded pair on first use).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q
	$(VENV)/bin/python -m pytest -q -m integration
	$(VENV)/bin/python -m pytest -q -m realmodel

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q
