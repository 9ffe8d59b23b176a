"""The real embedded pair: prepared (downloaded and converted on first use) and loadable as a pair."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

import pytest

from treegraft_dist.models.prepare import prepare_default_models

pytestmark = pytest.mark.realmodel


@pytest.fixture(autouse=True)
def _free_the_models():
    """Each test loads the pair (GBs); the model objects hold reference cycles, which the collector, counting
    objects rather than bytes, may leave for many tests: collect them before the next test loads its pair."""
    yield
    gc.collect()
    if sys.platform.startswith("linux"):  # and hand the freed heap back to the system, so it is not counted
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def test_default_pair_is_prepared_and_shares_one_vocabulary():
    """Both checkpoints hold an input embedding row for every token of the one shared tokenizer (read from the
    files' headers: the tests below load the weights)."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    target_dir, middle_dir = prepare_default_models()
    target_tok, middle_tok = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(middle_dir)
    assert target_tok.get_vocab() == middle_tok.get_vocab()
    assert target_tok.chat_template and middle_tok.chat_template
    for folder in (target_dir, middle_dir):
        rows = []
        for file in sorted(folder.glob("model*.safetensors")):
            with safe_open(str(file), "pt") as f:
                rows += [f.get_slice(k).get_shape()[0] for k in f.keys() if k.endswith("embed_tokens.weight")]
        assert rows and rows[0] >= len(target_tok), folder


QUESTIONS = ("Write a Python function that returns the n-th Fibonacci number.",
             "What is the capital of France? Answer in one sentence.")


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in QUESTIONS]


def test_default_pair_is_lossless_on_short_prompts():
    from treegraft_dist.decoding.engine import Decoder
    from treegraft_dist.models.loading import check_pair, load_model

    target_dir, middle_dir = prepare_default_models()
    target = load_model(str(target_dir), "cpu", "float32")
    middle = load_model(str(middle_dir), "cpu", "float32", drafter=True)  # as the product loads it
    check_pair(target, middle)
    decoder = Decoder(target.lm, middle.lm)
    for prompt in _prompts(target.tokenizer):
        reference = decoder.generate(prompt, 24, "ar", target.eos_ids).tokens
        assert len(reference) > 0
        for method in ("all-small", "all-mid", "10000"):
            assert decoder.generate(prompt, 24, method, target.eos_ids).tokens == reference, method


def test_default_pair_in_bf16_with_the_scheduler_fitted_for_this_device(tmp_path):
    """The default path: bf16, the scheduler fitted here from the shipped trajectories, every method exact or a
    near-tie of the target's own logits (never a mismatch)."""
    import torch

    from treegraft_dist.decoding.config import TreeConfig
    from treegraft_dist.decoding.costs import profile_key
    from treegraft_dist.decoding.engine import Decoder
    from treegraft_dist.evaluation.lossless import MISMATCH, classify
    from treegraft_dist.models.loading import load_model
    from treegraft_dist.models.paths import cache_root
    from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
    from treegraft_dist.scheduling.device import PROFILE_KEY, resolve_scheduler
    from treegraft_dist.scheduling.value import ValuePlanner

    target_dir, middle_dir = prepare_default_models()
    target = load_model(str(target_dir), "cpu", "bfloat16")
    middle = load_model(str(middle_dir), "cpu", "bfloat16", drafter=True)
    assert target.lm.dtype == torch.bfloat16
    prompts = _prompts(target.tokenizer)
    scheduler, heads = resolve_scheduler(None, (DEFAULT_TARGET, DEFAULT_MIDDLE), target.lm, target.source, middle.lm,
                                         middle.source, cache_root(None), prompts[0], TreeConfig())
    key = profile_key(target.lm, target.source, middle.lm, middle.source)
    assert scheduler.info.cost_profile[PROFILE_KEY] == key and "bfloat16" in key
    budget = scheduler.info.cost_profile["budget"]
    decoder = Decoder(target.lm, middle.lm, TreeConfig(budget=budget))
    policies = ("all-small", "all-mid", scheduler, ValuePlanner(heads, scheduler.info.cost_profile["call_cap"]))
    for prompt in prompts:
        reference = decoder.generate(prompt, 24, "ar", target.eos_ids).tokens
        for policy in policies:
            tokens = decoder.generate(prompt, 24, policy, target.eos_ids).tokens
            check = classify(target.lm, prompt, reference, tokens)
            assert check.verdict != MISMATCH, (getattr(policy, "name", policy), check)
