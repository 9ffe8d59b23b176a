"""The real embedded pair: prepared (downloaded and converted on first use) and loadable as a pair."""

from __future__ import annotations

import pytest

from treegraft_dist.prepare import prepare_default_models

pytestmark = pytest.mark.realmodel


def test_default_pair_loads_and_shares_one_vocabulary():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, middle_dir = prepare_default_models()
    target_tok, middle_tok = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(middle_dir)
    assert target_tok.get_vocab() == middle_tok.get_vocab()
    assert target_tok.chat_template and middle_tok.chat_template
    for folder in (target_dir, middle_dir):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.get_input_embeddings().weight.shape[0] >= len(target_tok)


def test_default_pair_is_lossless_on_short_prompts():
    from treegraft_dist.config import TreeConfig
    from treegraft_dist.engine import Decoder
    from treegraft_dist.models import check_pair, load_model
    from treegraft_dist.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
    from treegraft_dist.scheduler import default_artifact
    from treegraft_dist.value import ValuePlanner, load_artifact

    target_dir, middle_dir = prepare_default_models()
    target = load_model(str(target_dir), "cpu", "float32")
    middle = load_model(str(middle_dir), "cpu", "float32")
    check_pair(target, middle)
    decoder = Decoder(target.lm, middle.lm)
    # The scheduler that ships for this pair loads for it and, at its budget, decodes losslessly too.
    scheduler, heads = load_artifact(default_artifact((DEFAULT_TARGET, DEFAULT_MIDDLE)),
                                     expect_pair=(DEFAULT_TARGET, DEFAULT_MIDDLE))
    cfg = TreeConfig(budget=scheduler.info.cost_profile["budget"])
    scheduled = Decoder(target.lm, middle.lm, cfg)
    for question in ("Write a Python function that returns the n-th Fibonacci number.",
                     "What is the capital of France? Answer in one sentence."):
        prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        reference = decoder.generate(prompt, 24, "ar", target.eos_ids).tokens
        assert len(reference) > 0
        for method in ("all-small", "all-mid"):
            assert decoder.generate(prompt, 24, method, target.eos_ids).tokens == reference, method
        for policy in (scheduler, ValuePlanner(heads, scheduler.info.cost_profile["call_cap"])):
            assert scheduled.generate(prompt, 24, policy, target.eos_ids).tokens == reference, policy.name
