"""Tiny randomly initialised model pairs that share a vocabulary, built in the test process."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from treegraft_dist.hf import CausalLM

VOCAB = 96


def _config(arch: str, hidden: int, layers: int, vocab: int, init: float):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(head_dim=hidden // 4, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = VOCAB,
               init: float = 0.25, attn: str = "sdpa"):
    cls, cfg = _config(arch, hidden, layers, vocab, init)
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
