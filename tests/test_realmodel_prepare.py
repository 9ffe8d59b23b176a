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
