"""`treegraft generate` end to end on tiny saved models: JSON output and one-line errors."""

import json
import subprocess
import sys

import pytest
from tiny import char_tokenizer, hf_greedy, perturbed_copy, save_tiny, tiny_model

from jobs.cli import main
from treegraft_dist.models.hf import CausalLM


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer()
    target = tiny_model("qwen3", init=0.4)
    t = save_tiny(root / "target", target, tok)
    m = save_tiny(root / "middle", perturbed_copy(target, 0.2, 1), tok)
    other = char_tokenizer()
    other.add_tokens(["<extra>"])
    o = save_tiny(root / "other", tiny_model("qwen3", vocab=97), other)
    return {"target": t, "middle": m, "other": o, "model": target, "tok": tok}


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("method", ["ar", "all-small", "all-mid", "01101"])
def test_generate_json_matches_target_greedy(pair_dirs, capsys, method):
    prompt = "abcabcabc hello hello"
    code, out, _ = run(capsys, "generate", "--target", pair_dirs["target"], "--middle", pair_dirs["middle"],
                       "--prompt", prompt, "--method", method, "--max-new-tokens", "24", "--dtype", "float32", "--json")
    assert code == 0
    res = json.loads(out)
    ids = pair_dirs["tok"](prompt)["input_ids"]
    assert res["token_ids"] == hf_greedy(CausalLM(pair_dirs["model"]), ids, 24)
    assert res["text"] == pair_dirs["tok"].decode(res["token_ids"])
    st = res["stats"]
    assert st["new_tokens"] == 24 and st["rounds"] == len(st["accepted"])
    assert set(st["seconds"]) == {"prefill", "ngram", "middle", "scheduler", "verify", "other"}


def test_generate_with_sampling_and_chat(pair_dirs, capsys):
    code, out, _ = run(capsys, "generate", "--target", pair_dirs["target"], "--middle", pair_dirs["middle"],
                       "--prompt", "hi", "--chat", "--method", "10101", "--max-new-tokens", "10",
                       "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 10


@pytest.mark.parametrize("args,needle", [
    (["--target", "/no/such/folder"], "does not exist"),
    (["--middle", "OTHER"], "tokenizers"),
    (["--prompt", "   "], "empty"),
    (["--prompt", "x" * 600], "context"),
    (["--budget", "0"], "budget"),
    (["--deepen", "-1"], "--deepen"),
    (["--tree-k", "0"], "--tree-k"),
    (["--middle-window", "-1"], "--middle-window"),
    (["--pin-match", "-1"], "--pin-match"),
    (["--method", "01x01"], "pattern"),
    (["--method", "0101"], "pattern"),
    (["--max-new-tokens", "-3"], "max-new-tokens"),
    (["--temperature", "-1"], "temperature"),
])
def test_bad_input_is_one_line_error(pair_dirs, capsys, args, needle):
    base = {"--target": pair_dirs["target"], "--middle": pair_dirs["middle"], "--prompt": "abc",
            "--method": "all-mid", "--max-new-tokens": "5"}
    for i in range(0, len(args), 2):
        base[args[i]] = pair_dirs["other"] if args[i + 1] == "OTHER" else args[i + 1]
    argv = ["generate"] + [x for kv in base.items() for x in kv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("treegraft: error:") and needle in last and "Traceback" not in err


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "generate", "--target", str(tmp_path / "x"),
                           "--prompt", "a", "--method", "ar"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("treegraft: error:") and "Traceback" not in proc.stderr
