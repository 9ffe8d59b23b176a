"""Adaptive tree sizing: the chosen tree is closed under ancestors, sized by cost, learned from verdicts, and
decoding with it still reproduces the target's greedy output."""

import numpy as np
import pytest
import torch
from test_engine import pair, prompts
from tiny import VOCAB, hf_greedy, perturbed_copy, tiny_model

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.sizing import CopyReach, TreeSizer
from treegraft_dist.decoding.tree import ORIGIN_NGRAM, DraftTree, Proposal
from treegraft_dist.models.hf import CausalLM


def chain_and_bush() -> DraftTree:
    """Root -> a 6-token chain (edge log-prob 0: a copied span), plus 3 siblings of its first token and
    2 children under each of them (edge log-prob -2)."""
    tree = DraftTree(0)
    parents = [0, 1, 2, 3, 4, 5] + [0, 0, 0] + [7, 7, 8, 8, 9, 9]
    n = len(parents)
    edge = np.array([0.0] * 6 + [-2.0] * 9)
    scores = np.zeros(n)
    for j, p in enumerate(parents):
        scores[j] = (scores[p - 1] if p else 0.0) + edge[j]
    tree.graft(Proposal(1, np.array(parents), np.arange(10, 10 + n), scores, ORIGIN_NGRAM), 1)
    return tree


def test_choice_is_ancestor_closed_and_follows_costs():
    tree = chain_and_bush()
    # Trees cost nothing up to 8 nodes, then a lot: the sizer takes 8 nodes, the best-ranked children first.
    sizer = TreeSizer({1: 100.0, 8: 100.0, 16: 400.0}, max_size=16)
    pruned, kept, choice = sizer.choose(tree)
    assert choice.size == 8 == pruned.size == len(kept)
    assert set(tree.parents[kept[1:]]) <= set(kept)
    assert {0, 1, 2, 7} <= set(kept)  # rank 0 before rank 1 at each depth (the prior)
    # A device where a one-node pass is far cheaper than any tree: plain decoding's step.
    sizer = TreeSizer({1: 10.0, 8: 100.0, 16: 400.0}, max_size=16)
    assert sizer.choose(tree)[2].size == 1
    # max_size bounds the choice even where bigger trees are free.
    sizer = TreeSizer({1: 100.0, 8: 100.0, 16: 100.0}, max_size=8)
    assert sizer.choose(tree)[2].size == 8
    with pytest.raises(ValueError, match="no measured tree size"):
        TreeSizer({16: 1.0}, max_size=8)


def test_acceptance_probabilities_learn_from_verdicts():
    tree = chain_and_bush()
    sizer = TreeSizer({1: 100.0, 16: 100.0}, max_size=16)
    before = sizer.acceptance(tree)
    assert before[0] == 1.0 and np.all(np.diff(before[1:7]) < 0)  # P falls down a path
    # Siblings' probabilities never sum past their parent's.
    assert before[[1, 7, 8, 9]].sum() <= 1.0 + 1e-12
    for _ in range(30):  # the chain is always accepted whole
        pruned, kept, _ = sizer.choose(tree)
        sizer.observe(tree, kept, [int(np.flatnonzero(kept == i)[0]) for i in range(1, 7)])
    after = sizer.acceptance(tree)
    assert after[6] > before[6] + 0.3
    assert after[7] < before[7]  # the siblings of an accepted node were rejected every time


@pytest.mark.parametrize("method", ["all-small", "01001"])
def test_sized_decoding_equals_target_greedy(method):
    target, mid = pair("llama", "close")
    sizer = TreeSizer({1: 10.0, 4: 11.0, 8: 12.0, 16: 20.0, 32: 35.0}, max_size=32)
    dec = Decoder(target, mid, sizer=sizer)
    sizes = []
    for prompt in prompts(7):
        gen = dec.generate(prompt, 40, method)
        assert gen.tokens == hf_greedy(target, prompt, 40), (method, prompt)
        sizes += gen.stats.tree_sizes
    assert len(set(sizes)) > 1  # the size follows the tree, not a constant


def test_a_new_request_starts_from_the_table_across_requests():
    tree = chain_and_bush()
    sizer = TreeSizer({1: 100.0, 16: 100.0}, max_size=16)
    prior = sizer.acceptance(tree)
    for _ in range(10):  # this request accepts the chain whole every round
        pruned, kept, _ = sizer.choose(tree)
        sizer.observe(tree, kept, [int(np.flatnonzero(kept == i)[0]) for i in range(1, 7)])
    within = sizer.acceptance(tree)
    sizer.start_request()
    fresh = sizer.acceptance(tree)
    # The request's own counts weigh more than what it taught the table across requests.
    assert prior[6] < fresh[6] < within[6]


def test_load_budget_shrinks_trees_as_requests_share_passes():
    from treegraft_dist.decoding.sizing import LoadBudget

    # A pass costs the same up to 8 rows, then grows with its rows (a memory-bound device, then compute-bound).
    costs = {1: 100.0, 2: 100.0, 4: 100.0, 8: 100.0, 16: 200.0, 32: 400.0, 64: 800.0}
    lb = LoadBudget(16, costs, alpha=0.6)
    assert lb(1) == 16  # alone: the configured budget
    assert lb(2) == 4  # 2 x 4 rows still ride free
    assert lb(8) == 1  # 8 one-token steps fill the free rows: plain decoding, batched
    assert lb(2, drafting_ms=500.0) == 1  # drafting (middle calls, say) would cost more than the tree gains
    # 2 x 4 rows would pay for 40 ms of drafting each, not for 70: the drafters serve the two one after the other.
    assert lb(2, drafting_ms=40.0) == 4 and lb(2, drafting_ms=70.0) == 1
    # Rounds of n-gram layers alone measured 5 ms, but any drafted round may call the middle drafter (70 ms).
    assert lb(2, drafting_ms=5.0) == 4 and lb(2, drafting_ms=5.0, call_ms=70.0) == 1
    assert lb(1, drafting_ms=5.0, call_ms=70.0) == 16  # alone, the request's own rounds decide (Payoff)
    assert [lb.cost(r) for r in (3, 8, 128)] == [100.0, 100.0, 1600.0]
    for _ in range(200):  # rounds of 8 nodes that accept 1 + 0.3 * 3 tokens: alpha follows
        lb.observe(8, 1.9)
    assert abs(lb.alpha - 0.3) < 0.01
    # Real passes of several requests cost more than the profile said: the curve follows what they cost.
    for _ in range(300):
        for rows, ms in ((8, 180.0), (12, 260.0), (16, 340.0)):
            lb.observe_pass(rows, ms)
    assert abs(lb.cost(8) - 180.0) < 2 and abs(lb.cost(16) - 340.0) < 2
    # Sizes no pass came near grow from the curve as the profile does (x2 a size), never cheaper than that.
    assert abs(lb.cost(32) - 2 * lb.cost(16)) < 1e-6 and abs(lb.cost(64) - 4 * lb.cost(16)) < 1e-6
    high = lb.cost(64)
    lb.observe_pass(300, 1e6)  # prompt chunks past the largest size do not move it
    assert lb.cost(64) == high
    with pytest.raises(ValueError):
        LoadBudget(8, {})


def test_alone_a_request_drafts_only_while_drafting_pays():
    from treegraft_dist.decoding.sizing import LoadBudget, Payoff

    costs = {1: 250.0, 2: 290.0, 4: 330.0, 8: 660.0}  # a compute-bound CPU: every node costs
    lb = LoadBudget(2, costs)
    payoff = Payoff()
    sizes = []
    for accepted in (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1):  # nothing drafted is ever accepted
        size = lb(1, drafting_ms=60.0, payoff=payoff)
        sizes.append(size)
        payoff.observe(size, accepted)
    # Two drafted rounds, then plain steps with ever rarer exploring rounds (after 1, 2, 4, 8 plain steps).
    assert sizes == [2, 2, 1, 2, 1, 1, 2, 1, 1, 1, 1, 2, 1, 1, 1, 1], sizes
    for _ in range(9):  # the text turns copyable: each drafted round now takes both nodes
        payoff.observe(lb(1, drafting_ms=60.0, payoff=payoff), 2)
    assert lb(1, drafting_ms=60.0, payoff=payoff) == 2 and payoff.patience == 1
    # 2 tokens for 290 + 60 ms beats 1 for 250 ms; with 400 ms of drafting it does not.
    winner = Payoff()
    for _ in range(2):
        winner.observe(2, 2)
    assert winner.pays(lb.cost, 60.0) and not winner.pays(lb.cost, 400.0)
    assert lb(1) == 2  # without a payoff: the budget, as before
    assert lb(1, payoff=Payoff()) == 2  # a request's first rounds draft


def test_exploring_rounds_are_small_and_drafted_without_the_middle():
    from treegraft_dist.decoding.sizing import LoadBudget, Payoff

    lb = LoadBudget(8, {1: 100.0, 2: 105.0, 4: 112.0, 8: 200.0})  # a 4-node pass costs about a step
    assert lb.probe_size == 4 and LoadBudget(8, {1: 100.0, 2: 300.0}).probe_size == 2
    payoff, plan = Payoff(), []
    for _ in range(12):  # drafting as the policy says costs 150 ms a round and nothing is accepted
        size = lb(1, drafting_ms=150.0, payoff=payoff)
        plan.append((size, payoff.middle))
        payoff.observe(size, 1)
    full, probe, plain = (8, True), (4, False), (1, False)
    # Exploring rounds: small trees of the n-gram drafter alone, after 1, 2, 4 plain steps.
    assert plan == [full, full, plain, probe, plain, plain, probe] + [plain] * 4 + [probe], plan
    plan = []
    for _ in range(12):  # the text turns copyable: a drafted round takes 3 tokens
        size = lb(1, drafting_ms=150.0, payoff=payoff)
        plan.append((size, payoff.middle))
        payoff.observe(size, 3 if size > 1 else 1)
    # Plain steps until the next exploring round (8 of them: patience 8 by now); it takes 3 tokens for about a step's pass,
    # so every round from then on is one (the n-gram drafter alone), while rounds with the middle drafter
    # (150 ms of drafting) do not pay yet.
    assert plan == [plain] * 8 + [probe] * 4, plan
    assert lb(1, 150.0, Payoff(1.2)) == 8  # untrusted, what earlier requests saw does not stop its own first rounds


def test_under_load_a_drafted_round_pays_the_middle_drafters_read_of_what_it_has_not_seen():
    from treegraft_dist.decoding.sizing import LoadBudget, Payoff, Reading

    # Two requests share passes that cost the same up to 8 rows: trees of 4 ride free, unless this request's middle
    # drafter must first read its prompt's window (256 tokens at 2 ms), which the other request's pass waits for.
    lb = LoadBudget(16, {1: 100.0, 2: 100.0, 4: 100.0, 8: 100.0, 16: 200.0}, alpha=0.6)
    payoff = Payoff(3.0, 8.0)
    assert lb(2, 20.0, payoff, Reading(context=256, remaining=200, token_ms=2.0)) == 1
    assert payoff.read == 0  # a plain step: nothing read
    assert lb(2, 20.0, payoff, Reading(context=10, remaining=200, token_ms=2.0)) == 4  # a short read pays
    assert payoff.read == 10 and payoff.middle  # the middle drafter has read up to this round's root
    assert lb(2, 20.0, payoff, Reading(context=13, remaining=197, token_ms=2.0)) == 4  # 3 new tokens: cheap
    assert lb(2, 20.0) == 4  # without a middle drafter to price


def test_later_requests_start_from_what_earlier_ones_measured_and_some_still_explore():
    from treegraft_dist.decoding.sizing import DraftingMeans, LoadBudget
    from treegraft_dist.decoding.stats import RequestStats

    lb = LoadBudget(8, {1: 100.0, 2: 105.0, 4: 112.0, 8: 200.0})
    means = DraftingMeans()

    def request(accepts: int) -> list[int]:
        """One request alone, every drafted round taking `accepts` tokens and costing 150 ms to draft."""
        stats, (payoff, spent) = RequestStats("treegraft"), means.start("treegraft")
        sizes = []
        for _ in range(4):
            size = lb(1, means.update(stats, payoff, spent), payoff)
            drafted = size > 1 and payoff.middle
            stats.seconds["middle"] += 0.15 if drafted else 0.0
            stats.tree_sizes.append(size)
            stats.accepted.append(accepts if drafted else 1)
            sizes.append(size)
        return sizes

    assert request(1)[:2] == [8, 8]  # the first request drafts its own first rounds, and they do not pay
    # Two drafted rounds are too few to trust: each request drafts its own until the means hold TRUST_ROUNDS.
    while means.by_method["treegraft"]["rounds"] < DraftingMeans.TRUST_ROUNDS:
        assert request(1)[:2] == [8, 8]
    while means.by_method["treegraft"]["requests"] % DraftingMeans.EXPLORE_EVERY:
        assert request(1)[0] == 1  # trusted from here: plain steps from round 1
    assert request(1)[:2] == [8, 8]  # one request in EXPLORE_EVERY measures again
    later = [request(1) for _ in range(DraftingMeans.EXPLORE_EVERY - 1)]
    assert all(s[0] == 1 and 8 not in s for s in later), later  # the next ones trust that: plain steps from round 1
    assert request(1)[:2] == [8, 8]
    # Where drafting pays (4 tokens a round for 350 ms against a 100-ms step), the next requests draft at once.
    fresh = DraftingMeans()
    means = fresh
    request(4)
    assert request(4) == [8, 8, 8, 8]


def test_drafting_is_priced_before_a_method_measured_it_so_a_first_burst_takes_plain_steps():
    from treegraft_dist.decoding.sizing import DraftingMeans, LoadBudget, Payoff
    from treegraft_dist.decoding.stats import RequestStats

    means = DraftingMeans()
    payoff, spent = means.start("treegraft")
    assert means.update(RequestStats("treegraft"), payoff, spent, prior_ms=60.0) == 60.0  # nothing measured yet
    # A CPU's passes: 16 requests' 2-node trees cost 1.28 times their plain steps.
    lb = LoadBudget(16, {1: 160.0, 2: 160.0, 4: 140.0, 8: 170.0, 16: 250.0, 32: 320.0, 64: 590.0})
    assert lb(16, 0.0, Payoff()) > 1  # drafting taken for free: 16 requests would each call the middle drafter
    assert lb(16, 60.0, Payoff()) == 1  # one middle call a round, one after another: plain steps


def test_the_middle_drafters_read_of_unseen_context_is_priced_against_the_tokens_left():
    from treegraft_dist.decoding.sizing import LoadBudget, Payoff, Reading

    lb = LoadBudget(8, {1: 100.0, 2: 105.0, 4: 112.0, 8: 200.0})
    # Earlier requests: 4 tokens a round for a 200-ms pass and 50 ms of drafting, against 1 token a 100-ms step:
    # over 100 tokens drafting saves 10,000 - 6,250 ms.
    def trusting() -> Payoff:
        return Payoff(4.0, 8.0, trust=True)

    assert lb(1, 50.0, trusting(), Reading(context=200, remaining=100, token_ms=3.0)) == 8  # a 600-ms read pays
    assert lb(1, 50.0, trusting(), Reading(context=2000, remaining=100, token_ms=3.0)) < 8  # a 6-s read does not
    assert lb(1, 50.0, trusting(), Reading(context=200, remaining=5, token_ms=3.0)) < 8  # nor 600 ms for 5 tokens
    payoff = trusting()
    assert lb(1, 50.0, payoff, Reading(200, 100, 3.0)) == 8 and payoff.middle
    # Once the middle drafter has read up to the round's root, the next round only prices what it lags.
    payoff.observe(8, 4)
    assert lb(1, 50.0, payoff, Reading(204, 5, 3.0)) == 8
    # Unmeasured, a request's first rounds explore with the middle unless even saving half the remaining time
    # could not pay the read back: a request under load, alone for its last 3 tokens of a long text.
    assert lb(1, 50.0, Payoff(), Reading(60, 32, 3.0)) == 8
    fresh = Payoff()
    assert lb(1, 50.0, fresh, Reading(900, 3, 3.0)) < 8 and not fresh.middle


@pytest.mark.parametrize("middle", ["close", "random"])
def test_drafting_only_while_it_pays_equals_target_greedy(middle):
    """With the device's costs the decoder drafts while drafting pays and takes plain steps where it does not;
    the output is the target's greedy decoding either way."""
    target, mid = pair("llama", middle)
    exact = CausalLM(perturbed_copy(target.model, 0.0, 0))  # a middle drafter that drafts the target's greedy path
    tree = TreeConfig(budget=8)
    costly = Decoder(target, mid, tree, verify_ms={1: 10.0, 2: 1000.0, 4: 1000.0, 8: 1000.0})  # trees never pay
    free = Decoder(target, exact, tree, verify_ms={1: 1e3, 2: 1e3, 4: 1e3, 8: 1e3})  # a tree costs a step
    for i, prompt in enumerate(prompts(8)[-3:]):  # a random prompt, then two repetitive ones
        a, b = costly.generate(prompt, 40, "01001"), free.generate(prompt, 40, "all-mid")
        assert a.tokens == b.tokens == hf_greedy(target, prompt, 40), (middle, prompt)
        plain = a.stats.tree_sizes.count(1)
        assert plain > len(a.stats.tree_sizes) / 2, a.stats.tree_sizes  # mostly plain steps
        # Each request drafts its own first rounds: the means do not yet hold enough drafted rounds to be trusted.
        first = 2
        assert a.stats.tree_sizes[:2] == [8, 8], a.stats.tree_sizes
        # Other drafted rounds explore: 2 nodes (the smallest tree), drafted by the n-gram drafter alone.
        explored = [(s, c) for s, c in zip(a.stats.tree_sizes[first:], a.stats.middle_calls[first:]) if s > 1]
        assert explored and all(s == 2 and c == 0 for s, c in explored), explored
        # Drafts the target accepts, trees as cheap as a step: drafting pays, every round drafts.
        assert 1 not in b.stats.tree_sizes and sum(b.stats.accepted) / b.stats.rounds > 2, b.stats.accepted


def copy_tree(length: int = 12) -> DraftTree:
    """Root -> a pinned chain of `length` copied tokens, plus two unpinned siblings of its first token."""
    tree = DraftTree(0)
    parents = list(range(length)) + [0, 0]
    pins = np.r_[np.ones(length, bool), False, False]
    tree.graft(Proposal(1, np.array(parents), np.arange(10, 12 + length), np.zeros(length + 2), ORIGIN_NGRAM,
                        pinned=pins), 1)
    return tree


def test_a_copy_that_goes_on_is_verified_past_the_budget_where_that_pays():
    tree = copy_tree()
    kept = tree.prune(4)[1]
    assert list(kept) == [0, 1, 2, 3]  # the budget holds the copy's first three tokens
    # A 12-node pass costs 1.5 four-node ones, a 16-node one 3: the chain's 13 nodes are not worth the step to 16.
    reach = CopyReach({1: 100.0, 4: 100.0, 8: 130.0, 12: 150.0, 16: 300.0})
    for _ in range(4):  # this request's copies are accepted as far as they are verified
        ids = reach.extend(tree, kept)
        assert ids is not None and list(ids) == list(range(len(ids)))  # the chain's first tokens, past the budget
        reach.observe(tree, ids, list(range(1, len(ids))))
    assert list(ids) == list(range(12))  # the copy goes on: as far as a 12-node pass reaches
    assert np.all(reach.q() > CopyReach.PRIOR)
    # A new request whose copies stop at once: the further tokens would be accepted if the first were (as far as
    # the table knows), so it takes a few rounds, but then only the budget is verified again.
    reach.start_request()
    rounds = 0
    while (ids := reach.extend(tree, kept)) is not None and rounds < 20:
        reach.observe(tree, ids, [])
        rounds += 1
    assert 1 <= rounds <= 8 and not reach.running
    # Where the pass grows steeply past the budget, never.
    steep = CopyReach({1: 100.0, 4: 100.0, 8: 400.0, 12: 600.0, 16: 800.0})
    assert steep.extend(tree, kept) is None
    # Only where the budget holds the copy alone: with an unpinned sibling kept, the budget stands.
    assert reach.extend(tree, np.array([0, 1, 2, 13])) is None
    with pytest.raises(ValueError, match="verification costs"):
        CopyReach({})


def copying_pair() -> tuple[CausalLM, CausalLM, list[int]]:
    """A target whose attention adds nothing (its next token follows from the last one alone), a middle drafter
    close to it, and a prompt that holds, earlier, the very span the target generates after it: the n-gram
    drafter copies that span from the prompt and the target accepts it whole."""
    model = tiny_model(seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target, mid = CausalLM(model), CausalLM(perturbed_copy(model, 0.3, 4))
    start = max(range(VOCAB), key=lambda a: len(set(hf_greedy(target, [a], 24))))  # the longest span before a loop
    return target, mid, [5, 6, 7, start] + hf_greedy(target, [start], 24) + [9, 8, 7, start]


@pytest.mark.parametrize("steep", [False, True])
def test_a_copied_span_is_verified_past_the_budget_and_output_equals_target_greedy(steep):
    target, mid, prompt = copying_pair()
    costs = {1: 10.0, 2: 10.0, 4: 10.0, 8: 11.0, 16: 12.0, 32: 20.0}
    if steep:  # passes past the budget cost far more than what the copy's tokens could save
        costs.update({8: 80.0, 16: 160.0, 32: 320.0})
    dec = Decoder(target, mid, TreeConfig(budget=4), reach=CopyReach(costs))
    gen = dec.generate(prompt, 30, "all-small")
    assert gen.tokens == hf_greedy(target, prompt, 30)
    if steep:
        assert max(gen.stats.tree_sizes) == 4
    else:  # the copy's 13 tokens (its first and a long chain of 12) in one pass, all accepted
        assert gen.stats.tree_sizes[:2] == [14, 14] and gen.stats.accepted[0] == 14
