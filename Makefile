# Every install step lives here. TORCH pins the PyTorch build; on a CUDA machine use e.g.
#   make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup eval scheduler test test-fast test-realmodel

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e .
	touch $(STAMP)

setup: $(STAMP)

# The main job on the embedded default pair, on CPU: one prompt of each of the six benchmarks, 64 new
# tokens, plain decoding against all-small, treegraft and the two Hugging Face peers (about 17 minutes
# on 2 cores, model preparation included). all-mid, value-planner and oracle: add them to --methods.
EVAL_METHODS ?= ar,all-small,treegraft,hf-assisted,hf-pld
eval: $(STAMP)
	$(VENV)/bin/treegraft eval --device cpu --prompts-per-benchmark 1 --max-new-tokens 64 \
		--methods $(EVAL_METHODS) --out out/eval

# Rebuild the scheduler artifact that ships for the embedded pair: trajectories (Ray Data, resumable;
# about 50 minutes on 2 cores for 30 prompts), then the value heads and the distilled MLP (2 minutes).
SCHEDULER_ARTIFACT := treegraft_dist/data/scheduler/qwen2.5-coder-1.5b+0.5b-instruct.npz
scheduler: $(STAMP)
	$(VENV)/bin/treegraft collect --device cpu --prompts-per-benchmark 6 --max-new-tokens 32 --out out/trajectories
	$(VENV)/bin/treegraft fit --data out/trajectories --out $(SCHEDULER_ARTIFACT)

# Fast suite, then the real-model smoke test (prepares the embedded pair on first use).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q
	$(VENV)/bin/python -m pytest -q -m realmodel

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q
