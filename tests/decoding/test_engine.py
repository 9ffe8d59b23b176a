"""The oracle: every speculative schedule reproduces the target's own greedy decoding, token for token."""

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import VOCAB, hf_greedy, perturbed_copy, tiny_model, tiny_pair

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder, draft_tree, speculate
from treegraft_dist.decoding.neural import NeuralDrafter
from treegraft_dist.decoding.ngram import NGramDrafter
from treegraft_dist.decoding.request import round_config, start_request
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.schedule import ReplaySchedule, fixed_schedule
from treegraft_dist.decoding.signals import NUM_SIGNALS, Timings
from treegraft_dist.decoding.stats import PhaseTimer, RequestStats
from treegraft_dist.decoding.tree import DraftTree
from treegraft_dist.decoding.verify import TargetVerifier
from treegraft_dist.models import hf
from treegraft_dist.models.hf import CausalLM

PAIRS = {}


def pair(arch, middle):
    if (arch, middle) not in PAIRS:
        PAIRS[arch, middle] = tiny_pair(arch, middle)
    return PAIRS[arch, middle]


def prompts(seed, n=4, length=24):
    rng = random.Random(seed)
    out = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]
    # Repetitive prompts: the n-gram drafter finds long matches.
    out.append([rng.randrange(VOCAB) for _ in range(6)] * 5)
    out.append(([3, 1, 4, 1, 5, 9, 2, 6] * 4)[:-3])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("middle", ["close", "random"])
def test_fixed_schedules_equal_target_greedy(arch, middle):
    target, mid = pair(arch, middle)
    dec = Decoder(target, mid)
    for prompt in prompts(hash((arch, middle)) % 1000):
        ref = hf_greedy(target, prompt, 40)
        for method in ("ar", "all-small", "all-mid", "01001", "10110"):
            assert dec.generate(prompt, 40, method).tokens == ref, (method, prompt)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.text("01", min_size=5, max_size=5),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
    repeat=st.integers(1, 3),
    arch=st.sampled_from(["llama", "qwen3"]),
    n=st.integers(0, 30),
)
def test_random_schedules_equal_target_greedy(pattern, prompt, repeat, arch, n):
    target, mid = pair(arch, "close")
    prompt = (prompt * repeat)[:60]
    got = Decoder(target, mid).generate(prompt, n, pattern).tokens
    assert got == hf_greedy(target, prompt, n)


@settings(max_examples=12, deadline=None)
@given(depth=st.integers(1, 5), top_k=st.integers(1, 6), lookback=st.integers(0, 5), budget=st.integers(1, 40),
       chain=st.integers(0, 4), seed=st.integers(0, 10_000))
def test_any_tree_shape_is_lossless(depth, top_k, lookback, budget, chain, seed):
    target, mid = pair("qwen3", "close")
    rng = random.Random(seed)
    pattern = "".join(rng.choice("01") for _ in range(depth))
    cfg = TreeConfig(depth=depth, top_k=top_k, lookback=lookback, budget=budget, chain=chain)
    prompt = [rng.randrange(VOCAB) for _ in range(8)] * 3
    got = Decoder(target, mid, cfg).generate(prompt, 30, pattern)
    assert got.tokens == hf_greedy(target, prompt, 30)
    assert max(got.stats.tree_sizes) <= budget


def test_perfect_drafter_accepts_deep_paths_and_stays_exact():
    # The middle drafter is the target itself: acceptance is long, so caches are compacted across many
    # multi-token rounds.
    model = tiny_model("llama", init=0.6)
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.0, 0))
    prompt = list(range(10, 30))
    got = Decoder(target, mid).generate(prompt, 60, "all-mid")
    assert got.tokens == hf_greedy(target, prompt, 60)
    assert got.stats.mean_accepted > 3


def test_eos_stops_like_plain_decoding():
    target, mid = pair("llama", "close")
    prompt = [5, 6, 7, 8] * 4
    ref = hf_greedy(target, prompt, 40)
    eos = ref[17]
    expected = ref[: ref.index(eos) + 1]
    perfect = CausalLM(perturbed_copy(target.model, 0.0, 0))  # accepts whole paths: eos lands inside a round
    for drafter, method in [(mid, "ar"), (mid, "all-small"), (mid, "all-mid"), (mid, "01001"), (perfect, "all-mid")]:
        g = Decoder(target, drafter).generate(prompt, 40, method, eos_ids={eos})
        assert g.tokens == expected
        # Decoding stops in the round that accepts eos: no round is spent past it, none is counted.
        assert 1 + sum(g.stats.accepted) == g.stats.new_tokens == len(expected), method


def test_statistics_are_consistent():
    target, mid = pair("qwen3", "close")
    prompt = [1, 2, 3, 4, 5, 6] * 4
    g = Decoder(target, mid).generate(prompt, 50, "01001")
    s = g.stats
    assert s.new_tokens == len(g.tokens) == 50
    assert s.rounds == len(s.accepted) == len(s.tree_sizes) == len(s.middle_calls)
    # The first token comes from the prefill; every round adds its accepted tokens and a bonus token.
    assert 1 + sum(s.accepted) >= 50 > sum(s.accepted[:-1]) + 1
    assert all(c >= 2 for c in s.middle_calls)  # 01001's two, and any deepening layer after its last
    assert all(1 <= t <= 64 for t in s.tree_sizes)
    assert s.wall_s >= sum(v for k, v in s.seconds.items() if k != "other") - 1e-6
    assert s.seconds["middle"] > 0 and s.seconds["ngram"] > 0 and s.seconds["verify"] > 0


def test_callable_policy_gets_17_signals_and_call_budget_holds():
    target, mid = pair("llama", "close")
    seen = []

    def policy(signals, layer):
        seen.append((layer, signals))
        return True

    cfg = TreeConfig(call_budget=2, deepen=0)  # the budget holds within the depth layers
    prompt = [9, 8, 7, 6, 5] * 4
    g = Decoder(target, mid, cfg).generate(prompt, 30, policy)
    assert g.tokens == hf_greedy(target, prompt, 30)
    assert all(c == 2 for c in g.stats.middle_calls)
    assert [layer for layer, _ in seen[:5]] == [0, 1, 2, 3, 4]
    sig = seen[3][1]
    assert sig.shape == (NUM_SIGNALS,) and np.isfinite(sig).all()
    # Call prefix before layer 3: two calls (layers 0 and 1), the budget refused layer 2.
    assert sig[4] == pytest.approx(3 / 5) and sig[5] == pytest.approx(2 / 5)
    assert list(sig[6:11]) == [1, 1, 0, 0, 0]


def test_middle_required_for_middle_schedules():
    target, _ = pair("llama", "close")
    dec = Decoder(target, None)
    assert dec.generate([1, 2, 3], 5, "all-small").tokens == hf_greedy(target, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="middle drafter"):
        dec.generate([1, 2, 3], 5, "all-mid")
    with pytest.raises(ValueError, match="pattern"):
        dec.generate([1, 2, 3], 5, "0120")
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], 5, "all-small")


def test_eager_and_sdpa_attention_agree():
    # The tree mask is an additive float mask, which both attention kernels accept. Blocks of more than
    # SMALL_BLOCK rows (prefill, big trees) attend through the model's own implementation, smaller ones on a
    # CPU through small_block_attention: both paths, under both implementations, give the same hidden states.
    eager, sdpa = CausalLM(tiny_model("qwen3", attn="eager")), CausalLM(tiny_model("qwen3", attn="sdpa"))
    assert eager.model.config._attn_implementation == "eager" and sdpa.model.config._attn_implementation == "sdpa"
    prompt = [4, 4, 2, 7, 1, 4, 4, 2] * 3
    tree = torch.tril(torch.ones(20, 20, dtype=torch.bool))
    tree[5:, 2:5] = False  # rows 5.. skip three positions: a tree block, not a causal one
    caches = [eager.new_cache(), sdpa.new_cache()]
    for n, attend in ((len(prompt), None), (20, tree), (6, tree[:6, :6]), (1, None)):
        past = hf.cache_len(caches[0])
        ids, pos = torch.arange(1, n + 1) % VOCAB, torch.arange(past, past + n)
        a, b = (lm.hidden(c, ids, pos, attend) for lm, c in zip((eager, sdpa), caches))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert a.abs().sum() > 0
    mid = CausalLM(perturbed_copy(eager.model, 0.2, 3))
    expected = hf_greedy(eager, prompt, 30)
    assert expected == hf_greedy(sdpa, prompt, 30)
    assert Decoder(eager, mid).generate(prompt, 30, "10101").tokens == expected
    assert Decoder(sdpa, mid).generate(prompt, 30, "10101").tokens == expected


@pytest.mark.parametrize("pattern", ["00000", "10000", "01100", "11111"])
@pytest.mark.parametrize("replay", [False, True])
def test_skipped_layers_never_change_the_pruned_tree(pattern, replay):
    # Each round is drafted twice from the same drafter state: bounded by the budget (settled n-gram
    # layers skipped) and unbounded; both must prune to the same nodes with the same data. A replayed
    # schedule does not say its later layers in advance: only a spent call budget lets layers be skipped.
    target, mid = pair("llama", "close")

    def policy():
        return ReplaySchedule([pattern]) if replay else fixed_schedule(pattern, 5)

    skipped = 0
    for budget, call_budget, prompt in [(1, None, [3, 1, 4, 1, 5, 9, 2, 6] * 4), (2, None, list(range(20)) * 2),
                                        (4, 1, [7, 7, 3, 2] * 6), (8, None, [5, 6, 7, 8, 9] * 5),
                                        (16, 0, [1, 2, 3] * 8)]:
        cfg = TreeConfig(budget=budget, call_budget=call_budget)
        verifier = TargetVerifier(target, SamplingParams())
        first, prefill = verifier.prefill(prompt)
        ngram, middle = NGramDrafter.from_config(cfg), NeuralDrafter(mid, cfg.top_k, cfg.lookback)
        for d in (ngram, middle):
            d.start(prompt, prefill)
            d.accept([], [first])
        root, timer = first, PhaseTimer(RequestStats("t"))
        for _ in range(6):
            start = middle.snapshot()
            full, full_calls = draft_tree(root, cfg, policy(), ngram, middle, timer, None)
            middle.restore(start)
            # Bounded by the budget and by smaller probe budgets as well.
            probes = (budget, max(1, budget // 2), max(1, budget // 4))
            tree, calls = draft_tree(root, cfg, policy(), ngram, middle, timer, None, probes)
            # A copy's pins that fill the budgets (or a budget of the root alone) stop drafting too, middle layers
            # included: the same nodes are verified, though later layers would have rescored them (verification
            # reads only what they are and where they hang).
            copied = all(tree.pins_fill(b) for b in probes)
            assert calls == full_calls if not copied else sum(calls) <= sum(full_calls)
            skipped += tree.size < full.size
            for b in probes:
                (pruned, kept), (want, want_kept) = tree.prune(b), full.prune(b)
                np.testing.assert_array_equal(kept, want_kept)
                exact = () if copied else ("scores", "expanded")
                for name in ("tokens", "parents", "depths", "origins", "layers") + exact:
                    np.testing.assert_array_equal(getattr(pruned, name)[: pruned.size],
                                                  getattr(want, name)[: want.size])
            pruned, kept = tree.prune(budget)
            verdict = verifier.verify(pruned)
            path = [0] + [int(kept[i]) for i in verdict.accepted]
            for d in (ngram, middle):
                d.accept(path, verdict.tokens)
            root = verdict.tokens[-1]
    assert skipped or replay


@pytest.mark.parametrize("method", ["all-small", "01001", "all-mid"])
def test_plain_step_rounds_tell_the_drafters_once_and_stay_exact(method):
    # Under load a round can shrink to the root alone (a plain step, nothing drafted). Its token reaches
    # the drafters only when a later round drafts, in one accept for the run of steps: the output is still
    # the target's greedy decoding, and the drafters hear once per drafting round, not once per step.
    target, mid = pair("llama", "close")
    cfg = TreeConfig(budget=8)
    for seed, prompt in enumerate(prompts(7, n=2)):
        rng = random.Random(seed)
        sizes = iter([rng.choice([1, 1, 1, 2, 8]) for _ in range(100)])
        verifier = TargetVerifier(target, SamplingParams())
        accepts = []

        class Counted:
            """A drafter that records how many tokens each accept tells it."""

            def __init__(self, d):
                self.d, self.origin, self.alive, self.fallback_steps = d, d.origin, True, 0

            def start(self, p, c):
                self.d.start(p, c)

            def step(self, tree, frontier, layer):
                return self.d.step(tree, frontier, layer)

            def accept(self, path, tokens):
                accepts.append(len(tokens))
                self.d.accept(path, tokens)

            def release(self):
                self.d.release()

        def drafters(req):
            return (Counted(NGramDrafter.from_config(req.cfg)),
                    Counted(NeuralDrafter(mid, req.cfg.top_k, req.cfg.lookback)))

        req = start_request(prompt, 40, set(), fixed_schedule(method, cfg.depth), cfg,
                            timings=lambda: Timings(100.0, 25.0), prefill=verifier.prefill, drafters=drafters)
        out = speculate(req, verifier.verify, budget=lambda: next(sizes))
        stats = req.stats
        assert out[:40] == hf_greedy(target, prompt, 40)
        assert 1 in stats.tree_sizes and 2 in stats.tree_sizes
        # start's accept, then per drafting round its own and, when plain steps came before it, one for them;
        # plain steps at the end are told once the request ends
        want, behind = 1, False
        for n in stats.tree_sizes:
            want += (1 + behind) if n > 1 else 0
            behind = n == 1
        assert len(accepts) == 2 * (want + behind)
        # ... and every token exactly once: the first, then every round's
        assert sum(accepts[::2]) == 1 + sum(stats.accepted)


@pytest.mark.parametrize("method", ["11111", "01001", "11110", "10100"])
def test_deepening_follows_a_sure_middle_past_the_depth_and_stays_exact(method):
    # The middle drafter is the target itself, and its call priced cheap: rounds that called it go on drafting
    # while it is sure, whether their last layer was its own (its frontier goes on) or the n-gram drafter's
    # (the nodes it would expand next), so a round accepts more than depth + 1 tokens.
    model = tiny_model("llama", init=0.6)
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.0, 0))
    prompt = list(range(10, 30))
    ref = hf_greedy(target, prompt, 60)
    deep = Decoder(target, mid, TreeConfig(deepen=10, deepen_cost=0.05)).generate(prompt, 60, method)
    flat = Decoder(target, mid, TreeConfig(deepen=0)).generate(prompt, 60, method)
    assert deep.tokens == flat.tokens == ref
    calls = method.count("1")
    assert max(flat.stats.middle_calls) <= calls
    assert max(deep.stats.accepted) > 6 and max(deep.stats.middle_calls) > calls
    assert max(deep.stats.middle_calls) <= calls + 10
    assert deep.stats.rounds < flat.stats.rounds


def test_deepening_after_ngram_layers_prices_the_nodes_the_middle_drafter_has_not_read():
    # After n-gram layers a deepening call also reads the nodes they added: priced dear enough, it never pays,
    # while a round ending on a middle layer (which added nothing unread but its own frontier) still deepens.
    # A round without a middle call has no confidence of the middle's to deepen with.
    model = tiny_model("llama", init=0.6)
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.0, 0))
    prompt = list(range(10, 30))
    dear = TreeConfig(deepen=10, deepen_cost=0.05, deepen_row_cost=50.0)
    after_ngram = Decoder(target, mid, dear).generate(prompt, 40, "11110")
    assert max(after_ngram.stats.middle_calls) == 4
    assert max(Decoder(target, mid, dear).generate(prompt, 40, "11111").stats.middle_calls) > 5
    none = Decoder(target, mid, TreeConfig(deepen=10, deepen_cost=0.05)).generate(prompt, 40, "00000")
    assert none.stats.middle_calls == [0] * none.stats.rounds and max(none.stats.accepted) <= 1 + 5 + 12
    assert after_ngram.tokens == none.tokens == hf_greedy(target, prompt, 40)


def test_deepening_weighs_a_layer_against_the_rounds_own_budget():
    # A round sized for the load keeps fewer nodes: a deepening node must displace a better one, so a round that
    # keeps 2 nodes never deepens where one that keeps 64 does.
    model = tiny_model("llama", init=0.6)
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.0, 0))
    prompt = list(range(10, 30))
    cfg = TreeConfig(budget=64, deepen=10, deepen_cost=0.05)
    policy = Decoder(target, mid, cfg).resolve_policy("11111")
    calls = {}
    for keep in (64, 2):
        ngram, middle = NGramDrafter.from_config(cfg), NeuralDrafter(mid, cfg.top_k, cfg.lookback)
        for d in (ngram, middle):
            d.start(prompt[:-1], None)
            d.accept([], prompt[-1:])
        calls[keep] = sum(draft_tree(prompt[-1], cfg, policy, ngram, middle, PhaseTimer(RequestStats("t")), None,
                                     (keep,))[1])
    assert calls[64] > 5 and calls[2] == 5


def test_deepening_stops_where_a_middle_call_costs_more_than_it_adds():
    target, mid = pair("llama", "random")  # a drafter that is rarely right
    prompt = prompts(7)[0]
    got = Decoder(target, mid, TreeConfig(deepen=10, deepen_cost=2.0)).generate(prompt, 30, "all-mid")
    assert got.tokens == hf_greedy(target, prompt, 30)
    assert max(got.stats.middle_calls) == 5


def test_deepening_cost_comes_from_the_measured_timings():
    target, mid = pair("qwen3", "close")
    dec = Decoder(target, mid, TreeConfig(deepen=3), timings=Timings(100.0, 25.0, 0.5))
    cfg = round_config(dec.cfg, dec.resolve_policy("all-mid"), lambda: dec.timings)
    assert cfg.deepen_cost == 0.25 and cfg.deepen_row_cost == 0.005  # a call, a token of its read
    # A schedule that never calls the middle drafter has nothing to deepen with, and needs no timings.
    assert round_config(dec.cfg, dec.resolve_policy("all-small"), lambda: 1 / 0).deepen_cost is None
    assert TreeConfig(deepen=3).max_tree_depth == TreeConfig(deepen=0).max_tree_depth + 3


def test_deepening_calibrates_the_middle_drafters_confidence_from_what_the_target_accepted():
    # A drafter sure of paths the target never takes (another peaky model): its deepening nodes are verified
    # and rejected, so the calibration falls and later requests price a middle call the more: they deepen less.
    target = CausalLM(tiny_model("llama", init=0.6))
    mid = CausalLM(tiny_model("llama", seed=5, init=0.6))
    dec = Decoder(target, mid, TreeConfig(deepen=10), timings=Timings(100.0, 1.0))
    assert dec.deepening.ratio == 1.0
    prompt = list(range(10, 34))
    runs = [dec.generate(prompt, 30, "all-mid") for _ in range(4)]
    assert all(g.tokens == hf_greedy(target, prompt, 30) for g in runs[:1]) and runs[-1].tokens == runs[0].tokens
    first, last = runs[0].stats, runs[-1].stats
    assert first.deep_expected > 1 and first.deep_accepted == 0 and max(first.middle_calls) > 5
    assert dec.deepening.ratio < 0.2
    assert sum(last.middle_calls) < sum(first.middle_calls)


@pytest.mark.parametrize("window", [1, 5, 24])
def test_a_middle_drafter_reading_a_window_of_the_prompt_stays_exact_and_reads_only_the_window(window):
    target, mid = pair("llama", "close")
    cfg = TreeConfig(budget=16, middle_window=window)
    prompt = prompts(7)[0] + prompts(8)[4]  # 54 tokens: the window is shorter
    got = Decoder(target, mid, cfg).generate(prompt, 30, "all-mid")
    assert got.tokens == hf_greedy(target, prompt, 30)
    assert sum(got.stats.middle_calls) > 0
    # Its first call reads the window (less the root, which runs with the tree), not the whole prompt.
    drafter = NeuralDrafter(mid, cfg.top_k, cfg.lookback, cfg.middle_window)
    drafter.start(prompt, None)
    drafter.accept([], got.tokens[:1])
    drafter.step(DraftTree(got.tokens[0]), np.zeros(1, np.int64), 1)
    assert drafter.forward_sizes[0] == window + 1
    assert cfg.middle_reads(len(prompt)) == window and TreeConfig(middle_window=0).middle_reads(len(prompt)) == 54


def test_a_middle_drafter_over_a_window_drafts_what_one_given_the_window_as_its_prompt_drafts():
    target, mid = pair("qwen3", "close")
    prompt = prompts(9)[1] + prompts(9)[5]
    windowed, alone = NeuralDrafter(mid, 4, 5, window=12), NeuralDrafter(mid, 4, 5)
    windowed.start(prompt, None)
    alone.start(prompt[-12:], None)
    for d in (windowed, alone):
        d.accept([], [3])
    a, b = (d.step(DraftTree(3), np.zeros(1, np.int64), 1) for d in (windowed, alone))
    assert a.tokens.tolist() == b.tokens.tolist() and np.allclose(a.scores, b.scores)
    with pytest.raises(ValueError, match="window"):
        NeuralDrafter(mid, 4, 5, window=-1)


class CallsEveryLayerButCopiesFirst:
    name, needs_signals, copies_first = "copies-first", False, True

    def decide(self, signals, layer: int) -> bool:
        return True


def test_a_policy_that_copies_first_leaves_a_copying_rounds_first_layer_to_the_ngram_drafter():
    target, mid = pair("llama", "close")
    span = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    cfg = TreeConfig(budget=16)
    for prompt, copying in ((span + [3, 40] + span[:5], True), (list(range(30, 50)), False)):
        ngram, middle = NGramDrafter.from_config(cfg), NeuralDrafter(mid, cfg.top_k, cfg.lookback)
        for d in (ngram, middle):
            d.start(prompt[:-1], None)
            d.accept([], prompt[-1:])
        tree, calls = draft_tree(prompt[-1], cfg, CallsEveryLayerButCopiesFirst(), ngram, middle,
                                 PhaseTimer(RequestStats("t")), None)
        assert calls == [not copying] + [True] * 4
        if copying:  # the copy's chain is in the tree: 5 tokens after the 5-token match, and more
            assert tree.follow(span[5:]) and len(tree.follow(span[5:])) == len(span) - 5
    got = Decoder(target, mid, cfg).generate(span + [3, 40] + span[:5], 30, CallsEveryLayerButCopiesFirst())
    assert got.tokens == hf_greedy(target, span + [3, 40] + span[:5], 30)


def test_a_copy_that_fills_the_budget_ends_the_rounds_drafting_with_the_same_tree():
    """Pruning keeps a copy's pinned chain first, so once it fills the budget no middle call can add a verified
    node: the round stops drafting there, and verifies exactly the tree full drafting would have."""
    target, mid = pair("llama", "close")
    span = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    prompt = span + [3, 40] + span[:5]
    for budget, filled in ((8, True), (14, True), (16, False)):
        cfg = TreeConfig(budget=budget)
        trees = []
        for settle in ((budget,), ()):
            ngram, middle = NGramDrafter.from_config(cfg), NeuralDrafter(mid, cfg.top_k, cfg.lookback)
            for d in (ngram, middle):
                d.start(prompt[:-1], None)
                d.accept([], prompt[-1:])
            tree, calls = draft_tree(prompt[-1], cfg, CallsEveryLayerButCopiesFirst(), ngram, middle,
                                     PhaseTimer(RequestStats("t")), None, settle)
            trees.append(tree)
            # 13 pins (the copied token and a long chain of 12) fill 8 and 14 nodes, not 16.
            assert calls == ([False] * 5 if settle and filled else [False] + [True] * 4)
        (short, kept), (full, full_kept) = (t.prune(budget) for t in trees)
        assert short.tokens.tolist() == full.tokens.tolist() and short.parents.tolist() == full.parents.tolist()
        assert trees[0].pins_fill(budget) == filled
    got = Decoder(target, mid, TreeConfig(budget=8)).generate(prompt, 30, CallsEveryLayerButCopiesFirst())
    assert got.tokens == hf_greedy(target, prompt, 30)
