"""What the benchmark scripts share: the revisions `round` and `ar` decode side by side, the pairs and
prompts the served benchmarks (`batching`, `serve`, `history`) run and the kernels they pin, the synthetic
prefill of the n-gram benchmarks (`ngram`, `scheduler`), and the tests' tiny models for `--pair tiny` runs."""

from __future__ import annotations

import atexit
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.schedule import ShallowTreeHeuristic
from treegraft_dist.evaluation.benchmarks import BENCHMARKS, builtin, chat_prompt
from treegraft_dist.models import compact, kernels
from treegraft_dist.models.paths import cache_root

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TARGET = "qwen2.5-coder-1.5b-instruct"
MIDDLE = "qwen2.5-coder-0.5b-instruct"
PHASES = ("prefill", "ngram", "middle", "scheduler", "verify", "other")
GENERATE = "generate"  # not a Decoder method: transformers' own greedy `model.generate`
# The drafting head's attribute on the model wrapper; revisions before it was public named it with an underscore.
HEAD_NAMES = ("draft_head", "_draft_head")
PREFILL_TOP_K = 10  # the target's top-k stored per prompt position during prefill


def start_ray(num_cpus: int = 2, object_store_mb: int = 300, **kwargs) -> None:
    """The local Ray cluster a served benchmark runs on: no dashboard, the workers' logs kept out of the tables."""
    import ray

    ray.init(num_cpus=num_cpus, object_store_memory=object_store_mb * 1024**2, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False, **kwargs)


def embedded_paths() -> tuple[Path, Path]:
    """The embedded target's and middle drafter's folders in the model cache (`make eval` prepares them)."""
    root = cache_root()
    return root / TARGET, root / MIDDLE


def tests_on_path() -> None:
    """Make the test suite's helpers importable (tests/tiny.py: the tiny random pair; tests/localserve.py: serve.yaml's
    application on it), as pytest's conftest does: the `--pair tiny` runs borrow them."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


# -- revisions side by side (round, ar) --------------------------------------------------------------------------

def import_revision(rev: str, scratch: Path) -> str:
    """Import `rev`'s package (`.` = the working tree now) under a name of its own; returns that name."""
    if rev == ".":
        name = "treegraft_worktree"
        shutil.copytree(ROOT / "treegraft_dist", scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.strip()
        name = f"treegraft_{sha}"
        archive = subprocess.run(["git", "archive", sha, "treegraft_dist"], cwd=ROOT, check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
        (scratch / "treegraft_dist").rename(scratch / name)
    if str(scratch) not in sys.path:
        sys.path.insert(0, str(scratch))
    importlib.import_module(name)
    return name


def module(package: str, *names: str):
    """`package`'s module under the first of `names` it has (revisions before the package was split into
    models/, decoding/, evaluation/ kept every module at the top)."""
    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if not e.name or not f"{package}.{name}".startswith(e.name):
                raise
    raise ModuleNotFoundError(f"{package} has none of {', '.join(names)}")


def load_middle(models, source: str, dtype: str, tokenizer):
    """The middle drafter as the evaluation loads it (int8 decoder linears where faster), where the revision
    has that option."""
    try:
        return models.load_model(source, "cpu", dtype, tokenizer, drafter=True)
    except TypeError:
        return models.load_model(source, "cpu", dtype, tokenizer)


class Models:
    """The embedded pair, loaded once (with the first revision's loader) and shared by all revisions."""

    def __init__(self, package: str, dtype: str, with_middle: bool):
        prepare = module(package, "models.prepare", "prepare")
        models = module(package, "models.loading", "models")
        benchmarks = module(package, "evaluation.benchmarks", "benchmarks")
        root = cache_root()
        for name in (TARGET, MIDDLE):
            if not (root / name / prepare.MARKER_NAME).is_file():
                raise SystemExit(f"{root / name} is not prepared yet: run `treegraft prepare-models` first")
        target = models.load_model(str(root / TARGET), "cpu", dtype)
        self.tokenizer = target.tokenizer
        self.target = target.lm.model
        middle = load_middle(models, str(root / MIDDLE), dtype, target.tokenizer) if with_middle else None
        self.middle = middle.lm.model if middle is not None else None
        # The drafting head over the draft vocabulary lives on the loader's wrapper: revisions that have one
        # take it over (a revision's own wrapper is built around the same model), under the name each gives it.
        self.draft_head = {}
        if middle is not None and hasattr(middle.lm, "draft_vocab"):
            head = next((getattr(middle.lm, k) for k in HEAD_NAMES if hasattr(middle.lm, k)), None)
            self.draft_head = {"draft_vocab": middle.lm.draft_vocab, **dict.fromkeys(HEAD_NAMES, head)}
        self.prompts = {}
        for name in benchmarks.BENCHMARKS:
            question = benchmarks.builtin(name)[0]
            self.prompts[name] = benchmarks.chat_prompt(self.tokenizer, [question.turns[0]], [])


class Revision:
    """One revision's decoding code over the shared models; hashes every tree its target verifies."""

    def __init__(self, rev: str, package: str, models: Models):
        self.rev = rev
        self.models = models
        hf = module(package, "models.hf", "hf")
        self.engine = module(package, "decoding.engine", "engine")
        self.config = module(package, "decoding.config", "config")
        self.target = hf.CausalLM(models.target)
        self.middle = hf.CausalLM(models.middle) if models.middle is not None else None
        for k, v in models.draft_head.items():
            if self.middle is not None and hasattr(self.middle, k):
                setattr(self.middle, k, v)
        self.digest = hashlib.sha1()
        verify = module(package, "decoding.verify", "verify")
        original = verify.TargetVerifier.verify

        def verify_and_hash(verifier, tree):
            self.digest.update(tree.tokens[: tree.size].tobytes())
            self.digest.update(tree.parents[: tree.size].tobytes())
            return original(verifier, tree)

        verify.TargetVerifier.verify = verify_and_hash

    def decode(self, bench: str, method: str, budget: int, new_tokens: int) -> dict:
        prompt = self.models.prompts[bench]
        if method == GENERATE:
            return hf_generate(self.models.target, prompt, new_tokens)
        self.digest = hashlib.sha1()
        decoder = self.engine.Decoder(self.target, self.middle, self.config.TreeConfig(budget=budget))
        gen = decoder.generate(prompt, new_tokens, method)
        s = gen.stats
        return {"tokens": gen.tokens, "wall_s": s.wall_s, "rounds": s.rounds, "seconds": dict(s.seconds),
                "accepted": s.accepted, "trees": self.digest.hexdigest()}


def hf_generate(model, prompt: list[int], new_tokens: int) -> dict:
    """transformers' greedy generate; its prefill (with the first token) is timed as a 1-token generate,
    so that the per-token decoding time compares with ours."""
    ids = torch.tensor([prompt])

    def generate(n):
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist(), time.perf_counter() - t

    _, prefill = generate(1)
    tokens, wall = generate(new_tokens)
    return {"tokens": tokens, "wall_s": wall, "rounds": new_tokens - 1, "seconds": {"prefill": prefill},
            "accepted": [], "trees": ""}


def load_revisions(revs: list[str], dtype: str, with_middle: bool) -> list[Revision]:
    """The revisions, over models loaded once; their packages stay on disk until the process exits (a
    function may import a module late)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-round-"))
    atexit.register(shutil.rmtree, scratch, True)
    packages = [import_revision(rev, scratch) for rev in revs]
    models = Models(packages[0], dtype, with_middle)
    return [Revision(rev, package, models) for rev, package in zip(revs, packages)]


def per_round_ms(r: dict) -> dict[str, float]:
    """ms per round of each phase, the prefill per request; `round` = (wall - prefill) / rounds."""
    rounds = max(r["rounds"], 1)
    out = {p: 1e3 * r["seconds"].get(p, 0.0) / (1 if p == "prefill" else rounds) for p in PHASES}
    out["round"] = 1e3 * (r["wall_s"] - r["seconds"].get("prefill", 0.0)) / rounds
    return out


# -- the served benchmarks (batching, serve, history) ----------------------------------------------------------

def pair_paths(kind: str, folder: str):
    """(target folder, middle folder, tokenizer)."""
    if kind == "embedded":
        from treegraft_dist.models.loading import load_tokenizer
        from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET, prepare_model

        t, m = str(prepare_model(DEFAULT_TARGET)), str(prepare_model(DEFAULT_MIDDLE))
        return t, m, load_tokenizer(t)
    tests_on_path()
    from tiny import char_tokenizer, perturbed_copy, save_tiny, tiny_model

    model, tok = tiny_model("llama", init=0.4), char_tokenizer()
    return (save_tiny(Path(folder) / "t", model, tok), save_tiny(Path(folder) / "m", perturbed_copy(model, 0.2, 1), tok),
            tok)


def served_default(kind: str, t_path: str, m_path: str, dtype: str, threads: int | None):
    """The policy `treegraft serve` gives its default method for this pair, found as the server finds it: for
    the embedded pair the scheduler fitted for this device (`fit_device_scheduler` in a Ray task on the
    target's resources; measured and fitted on first use, then read from the cache); for the tiny pair, which
    ships no trajectories, the shallow-tree heuristic. Returns (policy, the budget the server would verify at,
    a line that says which)."""
    if kind != "embedded":
        return ShallowTreeHeuristic(), TreeConfig().budget, "the shallow-tree heuristic (no trajectories ship)"
    import ray

    from jobs.serve import fit_device_scheduler
    from treegraft_dist.models.prepare import DEFAULT_MIDDLE, DEFAULT_TARGET
    from treegraft_dist.scheduling.device import PROFILE_KEY

    task = ray.remote(num_cpus=1, max_calls=1)(fit_device_scheduler)
    policy = ray.get(task.remote((DEFAULT_TARGET, DEFAULT_MIDDLE), t_path, m_path, "cpu", dtype, None, threads))
    profile = policy.info.cost_profile
    return policy, int(profile["budget"]), (f"the scheduler fitted for this device ({profile.get(PROFILE_KEY)}), "
                                            f"budget {profile['budget']}, tree width {policy.width}, call cap {profile.get('call_cap')}")


def bench_prompts(tok, n: int) -> list[list[int]]:
    names = list(BENCHMARKS)
    qs = [builtin(names[i % len(names)])[i // len(names)] for i in range(n)]
    return [chat_prompt(tok, [q.turns[0]], []) for q in qs]



def pin_kernels(dtype: torch.dtype, path: str | None = None) -> str:
    """The CPU linear path (`path`, or the one this process's probes choose for `dtype`) and the middle's int8
    decision, set in $TREEGRAFT_LINEAR and $TREEGRAFT_DRAFT_INT8 so that the Ray workers started from here run
    them too (each process probes on its own otherwise, and a near tie can send the target worker one way and
    this process the other)."""
    if path is None and dtype == compact.DTYPE and compact.choice().compact:
        path = "compact"
    elif path is None:
        path = "packed" if kernels.choice(dtype).packed else "stock"
    os.environ[kernels.LINEAR_ENV] = path
    int8 = kernels.int8_choice(dtype).int8
    os.environ[kernels.INT8_ENV] = "on" if int8 else "off"
    return f"{path} linears, middle {'in int8' if int8 else 'not in int8'}"


# -- the n-gram benchmarks (ngram, scheduler) ------------------------------------------------------------------

def synthetic_prefill(prompt: np.ndarray, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Top-k tokens and log-probs per prompt position; the true next token is in the top-k 70% of the time."""
    n = len(prompt)
    tokens = rng.integers(0, vocab, size=(n, PREFILL_TOP_K))
    nxt = np.append(prompt[1:], prompt[-1])
    hit = rng.random(n) < 0.7
    tokens[hit, rng.integers(0, PREFILL_TOP_K, size=n)[hit]] = nxt[hit]
    logits = np.sort(rng.normal(0, 2, size=(n, PREFILL_TOP_K)), axis=1)[:, ::-1]
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True) + 1.0)  # +1: the mass outside top-k
    return tokens, logprobs
