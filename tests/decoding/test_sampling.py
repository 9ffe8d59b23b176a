"""Temperature > 0: speculative samples follow the target's own sampling distribution (chi-square)."""

import math
from collections import Counter

import pytest
import torch
from tiny import perturbed_copy, tiny_model

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.sampling import SamplingParams, target_probs
from treegraft_dist.models.hf import CausalLM

VOCAB = 6
STEPS = 3


def exact_joint(lm: CausalLM, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(t0, t1, t2) under plain sampling from the target, by enumeration."""
    def probs(tokens):
        cache = lm.new_cache()
        h = lm.hidden(cache, torch.tensor(tokens), torch.arange(len(tokens)))
        return target_probs(lm.logits(h[-1:]), params)[0]

    out = {}
    p0 = probs(prompt)
    for t0 in range(VOCAB):
        p1 = probs(prompt + [t0])
        for t1 in range(VOCAB):
            p2 = probs(prompt + [t0, t1])
            for t2 in range(VOCAB):
                out[t0, t1, t2] = float(p0[t0] * p1[t1] * p2[t2])
    return out


def chi_square_ok(counts: Counter, expected: dict, n: int) -> tuple[bool, float, float]:
    """Pearson chi-square with cells of expected count < 5 pooled; threshold at p = 0.001."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    df = cells - 1
    z = 3.09  # one-sided p = 0.001; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.mark.parametrize("params,pattern", [
    (SamplingParams(temperature=1.0), "11011"),
    (SamplingParams(temperature=1.5, top_k=4, top_p=0.9), "01001"),
])
def test_speculative_sampling_matches_target_distribution(params, pattern):
    model = tiny_model("llama", vocab=VOCAB, init=0.3, seed=4)
    target = CausalLM(model)
    middle = CausalLM(perturbed_copy(model, 0.5, 9))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    expected = exact_joint(target, prompt, params)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-5)
    decoder = Decoder(target, middle, TreeConfig(top_k=3, budget=16), params)
    n = 1000
    counts = Counter(tuple(decoder.generate(prompt, STEPS, pattern, seed=s).tokens) for s in range(n))
    ok, stat, crit = chi_square_ok(counts, expected, n)
    assert ok, f"chi-square {stat:.1f} >= {crit:.1f}"
    # The same samples must fail against a nearby but different distribution: the test has power.
    hotter = SamplingParams(params.temperature * 1.5, params.top_k, params.top_p)
    assert not chi_square_ok(counts, exact_joint(target, prompt, hotter), n)[0]


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)[0]
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_seed_makes_sampling_reproducible():
    model = tiny_model("qwen3", vocab=VOCAB, init=0.5)
    target = CausalLM(model)
    dec = Decoder(target, CausalLM(perturbed_copy(model, 0.3, 1)), TreeConfig(top_k=3), SamplingParams(1.0))
    a = dec.generate([1, 2, 3] * 3, 20, "10101", seed=7).tokens
    assert a == dec.generate([1, 2, 3] * 3, 20, "10101", seed=7).tokens
    assert any(dec.generate([1, 2, 3] * 3, 20, "10101", seed=s).tokens != a for s in range(8, 12))


def test_a_temperature_below_greedy_below_decodes_greedily():
    """1e-40 would overflow fp32 logits (inf, then nan probabilities for multinomial): it is greedy instead."""
    from tiny import hf_greedy

    from treegraft_dist.decoding.sampling import GREEDY_BELOW, next_token

    tiny = SamplingParams(temperature=1e-40)
    assert tiny.greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([[3.0, 80.0, -2.0, 79.9]])
    assert next_token(logits[0], tiny, torch.Generator().manual_seed(0)) == 1
    assert target_probs(logits, tiny).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    model = tiny_model("llama", vocab=VOCAB, init=0.5, seed=2)
    target = CausalLM(model)
    dec = Decoder(target, CausalLM(perturbed_copy(model, 0.3, 1)), TreeConfig(top_k=3), tiny)
    prompt = [1, 2, 3, 4, 1, 2]
    for method in ("ar", "10101"):
        assert dec.generate(prompt, 12, method, seed=5).tokens == hf_greedy(target, prompt, 12)


def test_target_probs_stay_finite_at_the_smallest_sampled_temperature():
    from treegraft_dist.decoding.sampling import GREEDY_BELOW

    logits = torch.tensor([[1e4, -1e4, 9999.99, 0.0], [5.0, 5.0, -3.0, 1.0]])
    for params in (SamplingParams(GREEDY_BELOW), SamplingParams(GREEDY_BELOW, top_k=2, top_p=0.5)):
        p = target_probs(logits, params)
        assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2))
        assert p[0, 0] == 1.0 and p[1, 2] == 0.0
    assert target_probs(logits, SamplingParams(GREEDY_BELOW))[1, :2].tolist() == [0.5, 0.5]  # a tie stays a tie


@pytest.mark.parametrize("fields", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(temperature="1"), dict(top_k=1.5), dict(top_k=True), dict(top_k=-1),
                                    dict(top_p=float("nan")), dict(top_p=1.5)])
def test_bad_sampling_params_are_refused(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)


def test_seeds_are_those_manual_seed_takes():
    """The documented range is torch's own: both ends seed a generator, one past either end does not."""
    from treegraft_dist.decoding.sampling import SEED_MAX, SEED_MIN, check_seed

    for seed in (SEED_MIN, -1, 0, 2**63, SEED_MAX):
        check_seed(seed)
        torch.Generator().manual_seed(seed)
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises(ValueError, match="seed"):
            check_seed(seed)
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(seed)
    for seed in (1.0, "3", None, True):
        with pytest.raises(ValueError, match="seed"):
            check_seed(seed)
