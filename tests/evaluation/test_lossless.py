"""The exact / near-tie / mismatch verdict (treegraft_dist/evaluation/lossless.py) on tiny models, alone and in the
evaluation: real ties are near-ties in bf16, our methods never mismatch, a broken acceptance rule always
does, fp32 stays exact."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import VOCAB, char_tokenizer, perturbed_copy, tiny_model

import treegraft_dist.decoding.verify as verify
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import Decoder, Generation
from treegraft_dist.evaluation.benchmarks import builtin, chat_prompt
from treegraft_dist.evaluation.evaluate import EvalConfig, Evaluation
from treegraft_dist.evaluation.lossless import (
    EXACT,
    MISMATCH,
    NEAR_TIE,
    ROUNDING_FACTOR,
    classify,
    target_logits,
    tolerance,
)
from treegraft_dist.evaluation.summary import summarize, summarize_folder
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import LoadedModel

PROMPT = [5, 17, 33, 60, 2, 71, 5, 17, 33, 60, 9, 40, 88, 5, 17]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """bf16 matrix products this small are far slower split over threads (on a busy 2-core machine,
    milliseconds instead of microseconds a call): run this module on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ar(lm: CausalLM, prompt: list[int], n: int) -> list[int]:
    return Decoder(lm).generate(prompt, n, "ar").tokens


def tied_target(dtype: torch.dtype, n: int = 16, k: int = 4, seed: int = 0):
    """A target whose lm head has two identical rows, a and b > a: their logits tie exactly at every position
    in any dtype, and argmax (first index on ties) gives a. Returns (lm, ar's tokens, an output that takes b
    where ar took a and then goes on as the target's greedy decoding, the position of that choice)."""
    model = tiny_model("llama", seed=seed)
    lm = CausalLM(model.to(dtype))
    a = ar(lm, PROMPT, n)[k]
    assert a < VOCAB - 1, "pick another k or seed: the tied twin must come after a"
    with torch.no_grad():
        model.lm_head.weight[a + 1] = model.lm_head.weight[a]
    ref = ar(lm, PROMPT, n)
    assert a in ref, "the tie must be on ar's path: pick another k or seed"
    p = ref.index(a)
    alt = ref[:p] + [a + 1]
    return lm, ref, alt + ar(lm, PROMPT + alt, n - len(alt)), p


def broken_accept(tree, argmax):
    """A wrong greedy rule: where the target's pick has no child in the tree, accept the first child anyway."""
    verdict = _right_accept(tree, argmax)
    node = verdict.accepted[-1] if verdict.accepted else 0
    kids = [i for i in range(1, tree.size) if int(tree.parents[i]) == node]
    if not kids:
        return verdict
    accepted = verdict.accepted + [kids[0]]
    return verify.Verdict(accepted, [int(tree.tokens[i]) for i in accepted] + [argmax[kids[0]]])


_right_accept = verify._accept_greedy


def test_identical_outputs_are_exact_and_a_prefix_is_a_mismatch():
    assert classify(None, PROMPT, [1, 2, 3], [1, 2, 3]).verdict == EXACT
    # Both stop by the same rules (eos, max_new_tokens): a length difference alone is never rounding.
    short = classify(None, PROMPT, [1, 2, 3], [1, 2])
    assert (short.verdict, short.diverge_at, short.logit_gap) == (MISMATCH, 2, None)
    assert "stops at 2 tokens" in short.reason


def test_tolerance_is_zero_in_fp32_and_scales_with_eps_and_the_logits():
    row = torch.tensor([-3.0, 20.0, 1.0])
    assert tolerance(torch.float32, row) == 0.0
    assert tolerance(torch.bfloat16, row) == pytest.approx(ROUNDING_FACTOR[torch.bfloat16] * 2**-7 * 20)
    assert tolerance(torch.float16, row) == pytest.approx(ROUNDING_FACTOR[torch.float16] * 2**-10 * 20)
    # A genuinely different choice, a few logits apart at the 1.5B target's logit scale, is not covered.
    assert tolerance(torch.bfloat16, torch.tensor([30.0])) < 3.0


def test_a_real_tie_is_a_near_tie_in_bf16_and_a_far_token_a_mismatch():
    lm, ref, alt, p = tied_target(torch.bfloat16)
    check = classify(lm, PROMPT, ref, alt)
    assert (check.verdict, check.diverge_at, check.logit_gap) == (NEAR_TIE, p, 0.0)
    assert check.tolerance > 0
    # The same place with the target's least likely token instead: a wrong choice, far outside rounding.
    worst = int(target_logits(lm, PROMPT, ref, p)[0].argmin())
    wrong = ref[:p] + [worst]
    wrong += ar(lm, PROMPT + wrong, len(ref) - len(wrong))
    check = classify(lm, PROMPT, ref, wrong)
    assert check.verdict == MISMATCH and check.diverge_at == p and check.logit_gap > check.tolerance
    # A near-tie followed by a wrong token later is a mismatch too: after a flip every token is checked.
    late = alt[:-3] + [int(target_logits(lm, PROMPT, alt, len(alt) - 3)[0].argmin())] + alt[-2:]
    check = classify(lm, PROMPT, ref, late)
    assert check.verdict == MISMATCH and "below the target's best logit" in check.reason


def test_fp32_any_difference_is_a_mismatch_even_an_exact_tie():
    lm, ref, alt, p = tied_target(torch.float32)
    check = classify(lm, PROMPT, ref, alt)
    assert (check.verdict, check.diverge_at, check.logit_gap, check.tolerance) == (MISMATCH, p, 0.0, 0.0)


@pytest.fixture(scope="module")
def bf16_pair():
    target = tiny_model("llama", seed=2, init=0.4)
    middle = perturbed_copy(target, 0.3, 3)
    return CausalLM(target.to(torch.bfloat16)), CausalLM(middle.to(torch.bfloat16))


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(count):
        p = torch.randint(0, VOCAB, (30,), generator=g).tolist()
        out.append(p + p[:10])  # a repeat, so the n-gram drafter finds something
    return out


def test_our_methods_in_bf16_are_exact_or_near_ties(bf16_pair):
    target, middle = bf16_pair
    decoder = Decoder(target, middle, TreeConfig(budget=16))
    verdicts = []
    for prompt in prompts(3)[::2]:
        ref = decoder.generate(prompt, 24, "ar").tokens
        for method in ("all-small", "all-mid", "01001"):
            check = classify(target, prompt, ref, decoder.generate(prompt, 24, method).tokens)
            assert check.verdict in (EXACT, NEAR_TIE), (method, check)
            verdicts.append(check.verdict)
    # On this CPU (one thread) the second prompt flips at token 12 under every method, a gap of 0.0 logits
    # where ar's one-token pass and the tree pass round the top two apart: rounding, found and let through.
    assert len(verdicts) == 6


def test_a_broken_acceptance_rule_is_a_mismatch_in_bf16(bf16_pair, monkeypatch):
    target, middle = bf16_pair
    decoder = Decoder(target, middle, TreeConfig(budget=16))
    refs = [decoder.generate(p, 24, "ar").tokens for p in prompts(3)]
    monkeypatch.setattr(verify, "_accept_greedy", broken_accept)
    for prompt, ref in zip(prompts(3), refs):
        out = decoder.generate(prompt, 24, "all-small").tokens
        check = classify(target, prompt, ref, out)
        assert check.verdict == MISMATCH, check


# -- in the evaluation --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_loaded():
    tok = char_tokenizer()
    model = tiny_model("qwen3", init=0.4)
    target = LoadedModel(CausalLM(model.to(torch.bfloat16)), tok, "tiny-target")
    middle = LoadedModel(CausalLM(perturbed_copy(model, 0.2, 1).to(torch.bfloat16)), tok, "tiny-middle")
    return target, middle


def test_the_evaluation_fails_on_a_broken_rule_in_bf16(bf16_loaded, tmp_path, monkeypatch):
    target, middle = bf16_loaded
    monkeypatch.setattr(verify, "_accept_greedy", broken_accept)
    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["ar", "all-small"], prompts_per_benchmark=1, max_new_tokens=16,
                     out=tmp_path / "o", budget=16)
    summary = Evaluation(target, middle, cfg).run()
    assert [m for m, _, _ in summary.mismatches] == ["all-small"]
    rows = pq.read_table(tmp_path / "o" / "results.parquet").to_pylist()
    row = next(r for r in rows if r["method"] == "all-small")
    assert row["verdict"] == MISMATCH and row["lossless"] is False and row["diverge_at"] is not None
    assert row["logit_gap"] is not None and row["tolerance"] > 0
    assert next(r for r in rows if r["method"] == "ar")["verdict"] == EXACT
    table = summary.table()
    assert "exact/near-tie/mismatch" in table and "| lossless |" not in table
    assert "| 0/0/1 |" in table.split("| all-small |")[1].splitlines()[0]
    assert "exact,near_tie,mismatch" in (tmp_path / "o" / "summary.csv").read_text().splitlines()[0]


def test_a_near_tie_in_the_evaluation_is_noted_not_failed(tmp_path, capsys):
    """all-small's output replaced by the other branch of a real tie: noted, counted, not a mismatch."""
    tok = char_tokenizer()
    model = tiny_model("qwen3", init=0.4, seed=5).to(torch.bfloat16)
    ids = chat_prompt(tok, [builtin("gsm8k")[0].turns[0]], [])
    a = ar(CausalLM(model), ids, 16)[3]
    with torch.no_grad():
        model.lm_head.weight[a + 1] = model.lm_head.weight[a]
    tied = LoadedModel(CausalLM(model), tok, "tied")
    ref = ar(tied.lm, ids, 16)
    p = ref.index(a)
    alt = ref[:p] + [a + 1]
    alt += ar(tied.lm, ids + alt, 16 - len(alt))

    class OtherBranch(Evaluation):
        def runner(self, method, budget, probes=()):
            run = super().runner(method, budget, probes)
            if method != "all-small":
                return run

            def other(prompt, n):
                gen = run(prompt, n)
                return Generation(alt if prompt == ids else gen.tokens, gen.stats)

            return other

    cfg = EvalConfig(benchmarks=["gsm8k"], methods=["ar", "all-small"], prompts_per_benchmark=1, max_new_tokens=16,
                     out=tmp_path / "o", budget=16)
    summary = OtherBranch(tied, None, cfg).run()
    assert summary.mismatches == []
    assert "near-tie (rounding, not a mismatch): all-small on gsm8k/" in capsys.readouterr().err
    row = next(r for r in pq.read_table(tmp_path / "o" / "results.parquet").to_pylist() if r["method"] == "all-small")
    assert (row["verdict"], row["diverge_at"], row["logit_gap"], row["lossless"]) == (NEAR_TIE, p, 0.0, False)
    assert "| 0/1/0 |" in summary.table().split("| all-small |")[1].splitlines()[0]


def _row(method, tokens, wall, **extra):
    return {"method": method, "benchmark": "gsm8k", "prompt_id": "1", "turn": 1, "new_tokens": tokens,
            "wall_s": wall, "rounds": tokens, "mean_accepted": 1.0, "middle_calls": 0, **extra}


def test_speedup_is_a_ratio_of_tokens_per_second():
    # After a near-tie all-small stopped at eos after 5 tokens where ar decoded 10: 20 tok/s against 10.
    t = pa.Table.from_pylist([_row("ar", 10, 1.0, verdict=EXACT), _row("all-small", 5, 0.25, verdict=NEAR_TIE)])
    rows = {r["method"]: r for r in summarize(t, ["ar", "all-small"]).rows if r["benchmark"] == "gsm8k"}
    assert rows["all-small"]["speedup"] == pytest.approx(2.0)  # not the wall-time ratio, 4.0
    assert (rows["all-small"]["exact"], rows["all-small"]["near_tie"], rows["all-small"]["mismatch"]) == (0, 1, 0)
    # Equal token counts: the same as the wall-time ratio.
    t = pa.Table.from_pylist([_row("ar", 10, 1.0, verdict=EXACT), _row("all-small", 10, 0.4, verdict=EXACT)])
    rows = {r["method"]: r for r in summarize(t, ["ar", "all-small"]).rows if r["benchmark"] == "gsm8k"}
    assert rows["all-small"]["speedup"] == pytest.approx(2.5)


def test_an_old_results_file_without_verdicts_is_summarised(tmp_path):
    rows = [_row("ar", 10, 1.0, lossless=True), _row("all-small", 10, 0.5, lossless=False),
            _row("hf-pld", 10, 0.5, lossless=False)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "results.parquet")
    summary = summarize_folder(tmp_path)
    assert summary.mismatches == [("all-small", "gsm8k", "1")]  # the peer is only reported
    means = {r["method"]: r for r in summary.rows if r["benchmark"] == "(mean)"}
    assert (means["ar"]["exact"], means["all-small"]["mismatch"], means["hf-pld"]["mismatch"]) == (1, 1, 1)
