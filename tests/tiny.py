"""Tiny randomly initialised model pairs that share a vocabulary, built in the test process."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from treegraft_dist.files import write_parquet
from treegraft_dist.models.hf import CausalLM

VOCAB = 96


def _config(arch: str, hidden: int, layers: int, vocab: int, init: float, heads: int = 4, kv_heads: int = 2, **extra):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                  **{"tie_word_embeddings": False, **extra})
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(head_dim=hidden // heads, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = VOCAB,
               init: float = 0.25, attn: str = "sdpa", **config):
    """`config`: more config fields (heads, kv_heads, or any the architecture's config takes)."""
    cls, cfg = _config(arch, hidden, layers, vocab, init, **config)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    return model


def perturbed_copy(model, scale: float, seed: int):
    """A drafter close to the target: same weights plus noise (drafts are often, not always, right)."""
    clone = type(model)(model.config).float().eval()
    clone.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return clone


def tiny_pair(arch: str = "llama", middle: str = "close", seed: int = 0, vocab: int = VOCAB):
    """(target, middle) CausalLMs; middle is 'close' (perturbed copy) or 'random' (independent init)."""
    target = tiny_model(arch, seed=seed, vocab=vocab)
    if middle == "close":
        mid = perturbed_copy(target, 0.3, seed + 1)
    else:
        mid = tiny_model(arch, seed=seed + 100, hidden=32, layers=1, vocab=vocab)
    return CausalLM(target), CausalLM(mid)


def hf_greedy(lm: CausalLM, prompt: list[int], n: int) -> list[int]:
    """The oracle: transformers' own greedy generate."""
    if n == 0:
        return []
    ids = torch.tensor([prompt])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def char_tokenizer():
    """A character-level tokenizer over printable ASCII (95 ids) plus <unk>: VOCAB = 96 ids in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    return fast


def save_tiny(folder, model, tokenizer) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def write_trajectories(folder, target: CausalLM, middle: CausalLM, pair, prompts, tree, cost, budgets,
                       max_new_tokens: int):
    """A trajectories folder as `treegraft collect` writes it, collected here under `cost`: `prompts` are
    (benchmark, question id, token ids)."""
    from treegraft_dist.scheduling.collect import (
        MANIFEST,
        ROUNDS_DIR,
        SCHEMA_VERSION,
        Collector,
        part_name,
        records_table,
        )

    collector = Collector(target, middle, tree, cost, budgets)
    for bench, qid, ids in prompts:
        table = records_table(collector.rounds(ids, max_new_tokens), bench, qid, len(ids), budgets, cost)
        write_parquet(folder / ROUNDS_DIR / part_name(bench, qid), table)
    manifest = {"schema_version": SCHEMA_VERSION, "pair": list(pair), "tree": tree.to_dict(),
                "max_new_tokens": max_new_tokens, "cost_model": cost.to_dict(), "budgets": list(budgets)}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder
