"""Where a middle-drafter call's time goes inside a decode, against what the cost profile prices it at.

Runs `treegraft eval` with the arguments given after `--`, timing every step of the middle drafter, its
forwards and its top-k, and prints per method:
  calls, ms a call, forwards a call and tokens a forward (catch-up on accepted tokens and the tree nodes);
  of a call's ms: forwards, what the cost profile prices forwards of those sizes at (costs.middle_profile,
  as the scheduler's fit uses it; read from the model cache, or measured after the decodes), top-k over the
  draft vocabulary and the request's own tokens, the rest (masks, rescoring, reselecting);
  the prompt reads: a request's first call runs the whole prompt, a per-request cost no profile prices
  (kept out of the per-call figures).

    python -m jobs.bench.calls -- --device cpu --prompts-per-benchmark 1 --max-new-tokens 64 \\
        --benchmarks sum,gsm8k --methods ar,all-mid,treegraft --out out/bench-calls
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import numpy as np

from jobs import cli
from treegraft_dist.decoding import costs, engine, neural
from treegraft_dist.evaluation.evaluate import Evaluation
from treegraft_dist.models import hf
from treegraft_dist.models.paths import cache_root


class Recorder:
    """Wraps the drafter's step, the model's forward and top-k, and the evaluation (for its middle model), for
    one process."""

    def __init__(self):
        self.method = "?"
        self.evaluation: Evaluation | None = None
        self.calls: dict[str, list[dict]] = defaultdict(list)  # per method, one row per call
        self.reads: dict[str, list[tuple[int, float]]] = defaultdict(list)  # per method, (tokens, ms)
        self._call: dict | None = None

    def install(self) -> None:
        rec = self
        generate, step, process = engine.Decoder.generate, neural.NeuralDrafter.step, neural.NeuralDrafter.process
        hidden, top, init = hf.CausalLM.hidden, hf.CausalLM.top_logprobs, Evaluation.__init__

        def timed_generate(decoder, prompt, n, method="all-small", *a, **k):
            rec.method = getattr(method, "name", str(method))
            return generate(decoder, prompt, n, method, *a, **k)

        def timed_step(drafter, *a, **k):
            rec._call = {"forwards": [], "top_ms": 0.0}
            t = time.perf_counter()
            try:
                return step(drafter, *a, **k)
            finally:
                call, rec._call = rec._call, None
                call["ms"] = (time.perf_counter() - t) * 1e3 - call.pop("read_ms", 0.0)
                rec.calls[rec.method].append(call)

        def timed_process(drafter, tree, unseen):
            first = drafter.committed == 0 and len(unseen) > 0
            t = time.perf_counter()
            process(drafter, tree, unseen)
            if first and rec._call is not None:  # the prompt's read: out of this call's figures
                ms = (time.perf_counter() - t) * 1e3
                rec.reads[rec.method].append((drafter.forward_sizes[-1], ms))
                rec._call["read_ms"] = ms
                rec._call["forwards"].pop()
                rec._call["top_ms"] -= rec._call.pop("last_top", 0.0)

        def timed_hidden(lm, cache, ids, *a, **k):
            t = time.perf_counter()
            out = hidden(lm, cache, ids, *a, **k)
            if rec._call is not None:
                rec._call["forwards"].append((len(ids), (time.perf_counter() - t) * 1e3))
            return out

        def timed_top(lm, *a, **k):
            t = time.perf_counter()
            out = top(lm, *a, **k)
            if rec._call is not None:
                ms = (time.perf_counter() - t) * 1e3
                rec._call["top_ms"] += ms
                rec._call["last_top"] = ms
            return out

        def kept_evaluation(evaluation, *a, **k):
            init(evaluation, *a, **k)
            rec.evaluation = evaluation

        engine.Decoder.generate, neural.NeuralDrafter.step = timed_generate, timed_step
        neural.NeuralDrafter.process = timed_process
        hf.CausalLM.hidden, hf.CausalLM.top_logprobs, Evaluation.__init__ = timed_hidden, timed_top, kept_evaluation

    def profile(self) -> dict[int, float]:
        """The middle's cost profile (ms by forward tokens) as the scheduler's fit prices it."""
        middle = self.evaluation.middle
        return costs.middle_profile(middle.lm, middle.source, cache_root(self.evaluation.cfg.cache_dir))

    def table(self) -> str:
        profile = self.profile()
        lines = ["| method | calls | ms a call | forwards ms | profile's price | top-k ms | rest ms | "
                 "forwards a call | tokens a forward | prompt reads (tokens, ms) |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for method, calls in self.calls.items():
            fwd = np.array([sum(ms for _, ms in c["forwards"]) for c in calls])
            sizes = [n for c in calls for n, _ in c["forwards"]]
            price = np.array([sum(costs.interp(profile, n) for n, _ in c["forwards"]) for c in calls])
            total = np.array([c["ms"] for c in calls])
            top = np.array([c["top_ms"] for c in calls])
            reads = self.reads.get(method, [])
            read_text = ", ".join(f"{n}: {ms:.0f}" for n, ms in reads) or "-"
            lines.append(f"| {method} | {len(calls)} | {total.mean():.1f} | {fwd.mean():.1f} | {price.mean():.1f} | "
                         f"{top.mean():.1f} | {(total - fwd - top).mean():.1f} | "
                         f"{len(sizes) / len(calls):.2f} | {np.mean(sizes) if sizes else 0:.1f} | {read_text} |")
        return "\n".join(lines)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] != "eval":
        args = ["eval"] + args
    rec = Recorder()
    rec.install()
    code = cli.main(args)
    if rec.calls:
        print("\nmiddle-drafter calls inside the decodes (ms; forward tokens include the catch-up):\n")
        print(rec.table())
    elif not code:
        code = "no middle-drafter call was made: run methods that call it (all-mid, treegraft, a pattern with a 1)"
    sys.exit(code)  # the evaluation's own exit status (it said why)


if __name__ == "__main__":
    main()
