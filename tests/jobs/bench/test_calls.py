"""`python -m jobs.bench.calls` on tiny models: every middle call of an evaluation timed and split, the prompt reads
kept apart, and a run without a middle call refused."""

import json
import subprocess
import sys
from pathlib import Path

from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

ROOT = Path(__file__).parents[3]


def run(tmp_path, methods: str) -> subprocess.CompletedProcess:
    tok = char_tokenizer()
    model = tiny_model("llama", init=0.4)
    t = save_tiny(tmp_path / "t", model, tok)
    m = save_tiny(tmp_path / "m", perturbed_copy(model, 0.2, 2), tok)
    bench = tmp_path / "mine.jsonl"
    bench.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [q]})
                               for i, q in enumerate(["abab abab abab abab", "the cat sat on the mat, the cat"])))
    return subprocess.run([sys.executable, "-m", "jobs.bench.calls", "--", "eval", "--target", t, "--middle", m, "--benchmarks", "",
                           "--benchmark-file", str(bench), "--methods", methods, "--prompts-per-benchmark", "2",
                           "--max-new-tokens", "10", "--budget", "8", "--out", str(tmp_path / "out"), "--device", "cpu",
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_every_call_is_split_into_forwards_top_k_and_the_rest(tmp_path):
    done = run(tmp_path, "ar,all-mid,01001")
    assert done.returncode == 0, done.stderr[-2000:]
    calls_table = done.stdout.split("middle-drafter calls")[1]  # not the evaluation's own table above it
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in calls_table.splitlines() if line.startswith("| all-mid") or line.startswith("| 01001")}
    assert set(rows) == {"all-mid", "01001"}
    for calls, per_call, forwards, price, top, rest, per_forward, tokens, reads in rows.values():
        assert int(calls) > 0 and float(per_call) >= float(forwards) > 0 and float(price) > 0
        assert float(top) > 0 and float(per_forward) > 0 and float(tokens) >= 1  # a call may need no forward
        # One prompt read per request (the warm-up's decodes included), each the whole prompt.
        assert len(reads.split(", ")) >= 2 and all(int(r.split(":")[0]) > 5 for r in reads.split(", "))
    assert "| ar |" not in done.stdout.split("middle-drafter calls")[1]


def test_a_run_without_middle_calls_says_so(tmp_path):
    done = run(tmp_path, "ar,all-small")
    assert done.returncode != 0 and "no middle-drafter call was made" in done.stderr
