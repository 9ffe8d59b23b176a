"""One prepared GPU check, minutes long, nothing downloaded: the cost profile, end-to-end decoding and
losslessness in bf16 on randomly initialised models of the shapes that matter.

    python jobs/gpu_check.py --device cuda --out out/gpu-check         # at most 8 minutes on one GPU
    python jobs/gpu_check.py --device cpu --quick --out /tmp/gpu-check # tiny models: how it is tested
    python -m jobs.gpu_check ...                                       # from the checkout, package not installed

Models, built from the configs written below (random weights; nothing is read or downloaded):
  embedded pair  the exact configs of the embedded Qwen2.5-Coder-1.5B-Instruct target and 0.5B-Instruct middle
                 drafter as `treegraft prepare-models` converts them (untied heads);
  70B proxy      a LLaMA-3-70B-shaped target (hidden 8192, 64 heads, 8 key/value heads, MLP 28672, vocab 128256)
                 built twice with few decoder layers, L1 and L2 (--proxy-layers): verification is measured on
                 both and extrapolated linearly to 80 layers per tree size, per layer (t(L2) - t(L1)) / (L2 - L1)
                 and the rest (embedding, head, overhead) t(L1) - L1 x that; on one GPU, unsharded (no tensor
                 parallelism, no NCCL); its middle drafter is LLaMA-3.2-1B-shaped, measured whole.
Stages, most needed first, each inside the time budget (--time-budget; a stage or size that no longer fits is
skipped, said so, and what was measured is kept):
  1. the embedded pair's cost profile as `treegraft eval` measures it: target verification by tree size 1..128 on
     a 256-token cache, middle forward by tokens, n-gram step and scheduler call (host);
  2. end to end on the embedded pair: ar, all-small, all-mid and a few patterns on a few prompts, ms per round
     by phase, and every output's verdict against ar (lossless.classify: exact / near-tie / mismatch); one
     sampled request twice with one seed (must repeat);
  3. the 70B proxy's and its middle drafter's profiles;
  and the peak GPU memory of each stage. A stage that fails is reported with its traceback and the next one
still runs. Written after every stage: OUT/profile.json, which `treegraft project --profile` reads directly (the embedded
pair's cost model and metadata at the top level, the proxy under "proxies"), and OUT/report.md.
Random weights accept differently from trained ones, so acceptance here means nothing: costs, kernels, numerics
and the decoding code paths on the device are what is checked. Exit status 1 on a mismatch or a failed stage.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import (
    CANDIDATES,
    MIDDLE_BLOCKS,
    PROFILE_PAST,
    CostModel,
    cpu_step_costs,
    device_name,
    forward_ms,
    profile_key,
)
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.stats import PHASES
from treegraft_dist.evaluation.benchmarks import builtin
from treegraft_dist.evaluation.lossless import MISMATCH, VERDICTS, classify
from treegraft_dist.files import write_json, write_text
from treegraft_dist.models import draft
from treegraft_dist.models.hf import CausalLM
from treegraft_dist.models.loading import DTYPES, check_supported, pick_device

# As `treegraft prepare-models` converts the embedded pair (config.json of each prepared folder).
QWEN_COMMON = dict(vocab_size=151936, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
                   rms_norm_eps=9.999999974752427e-07, rope_theta=1000000.0, tie_word_embeddings=False,
                   use_sliding_window=False, sliding_window=None, max_window_layers=28, attention_dropout=0.0,
                   bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
EMBEDDED_TARGET = dict(QWEN_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2)
EMBEDDED_MIDDLE = dict(QWEN_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2)
EMBEDDED_NAMES = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")  # the prepared folders' names
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                  rms_norm_eps=1e-05, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
                  initializer_range=0.02, bos_token_id=128000, eos_token_id=128009)
LLAMA32_1B = dict(LLAMA3_70B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                  rope_scaling={**LLAMA3_ROPE, "factor": 32.0})
PROXY_LAYERS = (2, 6)
BUILD_RESERVE_S = 60.0  # time a large model's build and first sizes need; less left: not built
PROXY_NAME = "llama-3-70b proxy"

# --quick: the same stages on tiny models (the test's sizes).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.4, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
QUICK_SIZES = (1, 2, 4, 8)

METHODS = ("ar", "all-small", "all-mid", "01001", "10000", "00100")
SAMPLED = ("all-mid", SamplingParams(temperature=1.0))
BUDGET = 64  # the published tree budget: on a GPU a 64-node pass costs about what a 1-node one does
DEFAULT_TIME_BUDGET_S = 420.0  # of the 8 minutes: interpreter and CUDA start-up come before it


class OutOfTime(Exception):
    """The time budget ran out inside a stage."""


@dataclass
class Deadline:
    """The time budget: `fits(s)` says whether `s` more seconds do; past its end (plus a grace) SIGALRM
    interrupts whatever is running, so the check ends on time even inside one long forward."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds

    @contextlib.contextmanager
    def alarm(self, grace_s: float = 20.0):
        if not hasattr(signal, "SIGALRM"):
            yield
            return

        def expire(*_):
            raise OutOfTime("the time budget ran out")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.0) + grace_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@dataclass
class Sizes:
    verify: tuple[int, ...]
    middle: tuple[int, ...]
    prompts: int
    new_tokens: int
    methods: tuple[str, ...]
    past: int
    repeats: int  # timed passes per size, the best kept (the 70B extrapolation multiplies a difference's noise)


FULL = Sizes(CANDIDATES, MIDDLE_BLOCKS, prompts=2, new_tokens=64, methods=METHODS, past=PROFILE_PAST, repeats=10)
QUICK = Sizes(QUICK_SIZES, QUICK_SIZES, prompts=1, new_tokens=12, methods=("ar", "all-small", "all-mid", "01001"),
              past=32, repeats=3)


def build(config, device: torch.device, dtype: torch.dtype, drafter: bool = False) -> CausalLM:
    """A randomly initialised model of `config`, created on `device` (no host copy of a large model), set up
    as load_model sets up what it loads: checked, packed, int8 for a `drafter` where that is faster, and a
    drafting head over the draft vocabulary (its special ids: the config's end, start and padding ids)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    check_supported(model.config, type(config).__name__)
    lm = CausalLM(model.to(device))
    if drafter:
        draft.quantize_middle(lm)
    lm.pack_linears()  # on a CPU, as load_model does where that is faster
    always = set()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        always.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    draft.set_draft_vocabulary(lm, draft.draft_vocabulary(lm.vocab_size, draft.vocab_setting(), always))
    return lm


def release_memory() -> None:
    """Give back what models no longer referenced held (on a GPU: to the driver, for the next stage)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_prompts(n: int, vocab: int, length: int) -> list[list[int]]:
    """Benchmark questions as character ids (no tokenizer here): text with the repetitions an n-gram drafter meets."""
    texts = [builtin(b)[0].turns[0] for b in ("humaneval", "gsm8k", "sum", "alpaca")][:n]
    return [[ord(c) % vocab for c in t][:length] for t in texts]


class Check:
    """The check's state: what it measured so far, rewritten to OUT after every stage."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype, sizes: Sizes):
        self.args, self.device, self.dtype, self.sizes = args, device, dtype, sizes
        self.deadline = Deadline(args.time_budget)
        self.out = Path(args.out)
        self.profile: dict = {}
        self.proxy: dict = {}
        self.runs: list[dict] = []
        self.sampled: dict = {}
        self.memory: dict[str, float] = {}
        self.skipped: list[str] = []
        self.failures: list[tuple[str, str]] = []  # (stage, traceback)
        self.models: tuple[CausalLM, ...] = ()  # the embedded pair, from its profile to the end-to-end runs
        self.env = {"device": device_name(device), "device_type": device.type, "dtype": str(dtype).removeprefix("torch."),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                    "python": platform.python_version(), "quick": args.quick, "time_budget_s": args.time_budget}

    # -- stages ---------------------------------------------------------------------------------------
    def stage(self, name: str, fn) -> None:
        if not self.deadline.fits(0):
            self.skipped.append(f"{name}: no time left")
            self.write()
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with self.deadline.alarm():
                fn()
        except OutOfTime:
            self.skipped.append(f"{name}: stopped by the time budget")
        except Exception:  # what a first run on this device finds: reported, and the next stage still runs
            self.failures.append((name, traceback.format_exc()))
            print(f"gpu_check: {name} failed:\n{self.failures[-1][1]}", file=sys.stderr)
        if self.device.type == "cuda":
            self.memory[name] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.write()

    def room_to_build(self, what: str) -> bool:
        """Whether there is time to build a large model (random initialisation cannot be interrupted: on a
        CPU a 70B-shaped layer set takes tens of seconds) and measure it; if not, say so."""
        reserve = 0.0 if self.args.quick else BUILD_RESERVE_S
        if self.deadline.fits(reserve):
            return True
        self.skipped.append(f"{what}: not built (under {reserve:.0f} s of the time budget left)")
        return False

    def sizes_within(self, lm: CausalLM, sizes, what: str, drafting: bool = False) -> dict[int, float]:
        """ms of one forward per block size, smallest first, stopping where the next would not fit the budget."""
        out, last_s, passes = {}, 0.0, self.sizes.repeats + 1
        for b in tqdm(sizes, desc=what, unit="size", file=sys.stderr):
            if not self.deadline.fits(2 * passes * last_s):  # a size costs at most about twice the last
                self.skipped.append(f"{what}: sizes from {b} on (time budget)")
                break
            t = time.monotonic()
            out[b] = forward_ms(lm, b, past=self.sizes.past, repeats=self.sizes.repeats, drafting=drafting)
            last_s = (time.monotonic() - t) / passes
        return out

    def embedded_profile(self) -> None:
        a = self.args
        target = build(self.config(EMBEDDED_TARGET), self.device, self.dtype)
        middle = build(self.config(EMBEDDED_MIDDLE), self.device, self.dtype, drafter=True)
        self.models = target, middle
        verify = self.sizes_within(target, self.sizes.verify, "target verification by tree size")
        mid = self.sizes_within(middle, self.sizes.middle, "middle forward by tokens", drafting=True)
        if not verify or not mid:
            self.skipped.append("embedded pair: no cost model (too few sizes measured), so no end-to-end runs")
            return
        context = host_prompts(1, target.vocab_size, 512)[0]
        ngram_ms, scheduler_ms = cpu_step_costs(context, TreeConfig(), repeats=50 if a.quick else 200)
        names = ("tiny-target", "tiny-middle") if a.quick else EMBEDDED_NAMES
        cost = CostModel(device_name(self.device), ngram_ms, scheduler_ms, mid, verify)
        self.profile = {"name": f"{' + '.join(names)} (random weights), {self.env['dtype']} on {cost.device}",
                        **cost.to_dict(), "past": self.sizes.past,
                        "profile_key": profile_key(target, names[0], middle, names[1]),
                        "note": "Measured by jobs/gpu_check.py on randomly initialised models of the embedded "
                                "pair's exact configs."}

    def end_to_end(self) -> None:
        target, middle = self.models
        s = self.sizes
        prompts = host_prompts(s.prompts, target.vocab_size, 256)
        decoder = Decoder(target, middle, TreeConfig(budget=BUDGET))
        for method in tqdm(s.methods, desc="warm-up", file=sys.stderr):
            decoder.generate(prompts[0], 4, method)
        reference, last_s = {}, 0.0
        bar = tqdm(total=len(prompts) * len(s.methods), desc="end to end", unit="run", file=sys.stderr)
        for i, prompt in enumerate(prompts):
            for method in s.methods:
                if not self.deadline.fits(2 * last_s):
                    self.skipped.append(f"end to end: {method} on prompt {i} and after (time budget)")
                    return
                t = time.monotonic()
                gen = decoder.generate(prompt, s.new_tokens, method)
                last_s = time.monotonic() - t
                if method == "ar":
                    reference[i] = gen.tokens
                check = classify(target, prompt, reference[i], gen.tokens)
                self.runs.append({"method": method, "prompt": i, "tokens": gen.tokens, "verdict": check.verdict,
                                  "reason": check.reason, "stats": gen.stats.to_dict()})
                bar.update()
        bar.close()
        if not self.deadline.fits(3 * last_s):
            self.skipped.append("the sampled request (time budget)")
            return
        method, params = SAMPLED
        sampler = Decoder(target, middle, TreeConfig(budget=BUDGET), params)
        draws = [sampler.generate(prompts[0], s.new_tokens, method, seed=0).tokens for _ in range(2)]
        self.sampled = {"method": method, "temperature": params.temperature, "seed": 0, "repeats": draws[0] == draws[1],
                        "tokens": draws[0]}

    def proxy_profile(self) -> None:
        self.models = ()
        release_memory()
        l1, l2 = self.args.proxy_layers
        measured, mid = {}, {}
        for layers in (l1, l2):
            if not self.room_to_build(f"70B proxy, {layers} layers"):
                break
            lm = build(self.config(LLAMA3_70B, layers), self.device, self.dtype)
            measured[layers] = self.sizes_within(lm, self.sizes.verify, f"70B proxy, {layers} layers, by tree size")
            del lm
            release_memory()
        if len(measured) == 2 and measured[l2] and self.room_to_build("1B middle"):
            middle = build(self.config(LLAMA32_1B), self.device, self.dtype, drafter=True)
            mid = self.sizes_within(middle, self.sizes.middle, "1B middle forward by tokens", drafting=True)
            del middle
            release_memory()
        measured = {k: measured.get(k, {}) for k in (l1, l2)}
        full = LLAMA3_70B["num_hidden_layers"]
        verify = {}
        for b in sorted(set(measured[l1]) & set(measured[l2])):
            per_layer = max(0.0, (measured[l2][b] - measured[l1][b]) / (l2 - l1))
            verify[b] = measured[l1][b] - l1 * per_layer + full * per_layer
        if not verify or not mid:
            self.skipped.append("70B proxy: no cost model (too few sizes measured)")
            return
        cost = CostModel(f"{device_name(self.device)} (70B proxy)", self.profile.get("ngram_ms", 0.0),
                         self.profile.get("scheduler_ms", 0.0), mid, verify)
        self.proxy = {**cost.to_dict(), "past": self.sizes.past, "layers_measured": [l1, l2], "layers": full,
                      "verify_ms_measured": {str(k): {str(b): v for b, v in m.items()} for k, m in measured.items()},
                      "note": f"LLaMA-3-70B-shaped target on one {self.env['device']}, unsharded: verification "
                              f"measured with {l1} and {l2} decoder layers and extrapolated linearly to {full} per "
                              "tree size (a negative per-layer difference, noise, counts as 0); middle drafter LLaMA-3.2-1B-shaped, measured whole; n-gram and scheduler "
                              "costs those of the embedded pair (host). Random weights; acceptance is the "
                              "trajectories' (the embedded pair's), not a 70B pair's."}

    def config(self, values: dict, layers: int | None = None):
        """The config for `values` (LLaMA or Qwen2 by its keys), at `layers` decoder layers; --quick: tiny."""
        cls = LlamaConfig if "rope_scaling" in values else Qwen2Config
        if self.args.quick:
            values = {**TINY, **({"use_sliding_window": False} if cls is Qwen2Config else {})}
        return cls(**{**values, **({"num_hidden_layers": layers} if layers else {})})

    # -- output ---------------------------------------------------------------------------------------
    def verdicts(self) -> dict[str, int]:
        return {v: sum(r["verdict"] == v for r in self.runs) for v in VERDICTS}

    def write(self) -> None:
        rounds = {}
        for method in dict.fromkeys(r["method"] for r in self.runs):
            stats = [r["stats"] for r in self.runs if r["method"] == method]
            n = max(1, sum(st["rounds"] for st in stats))
            rounds[method] = {"ms_per_round": 1e3 * sum(st["wall_s"] - st["seconds"]["prefill"] for st in stats) / n,
                              "phases_ms_per_round": {p: 1e3 * sum(st["seconds"][p] for st in stats) / n
                                                      for p in PHASES if p != "prefill"},
                              "accepted_per_round": sum(sum(st["accepted"]) for st in stats) / n,
                              "middle_calls_per_round": sum(sum(st["middle_calls"]) for st in stats) / n,
                              "mean_tree_size": sum(sum(st["tree_sizes"]) for st in stats) / n,
                              "tokens_per_s": sum(st["new_tokens"] for st in stats) / sum(st["wall_s"] for st in stats)}
        data = {**self.profile, "check": {**self.env, "seconds": round(time.monotonic() - self.deadline.start, 1),
                                          "skipped": self.skipped},
                "failures": [{"stage": n, "traceback": t} for n, t in self.failures],
                "rounds": rounds, "lossless": {**self.verdicts(), "runs": [
                    {k: r[k] for k in ("method", "prompt", "verdict", "reason")} for r in self.runs]},
                "sampled": self.sampled, "peak_memory_gib": self.memory,
                "proxies": {PROXY_NAME: self.proxy} if self.proxy else {}}
        write_json(self.out / "profile.json", data)
        write_text(self.out / "report.md", self.report(rounds))

    def report(self, rounds: dict) -> str:
        e = self.env
        lines = [f"# GPU check: {e['device']}, {e['dtype']}", "",
                 f"torch {e['torch']} (CUDA {e['cuda']}), transformers {e['transformers']}, Python {e['python']}; "
                 f"{time.monotonic() - self.deadline.start:.0f} s of a {e['time_budget_s']:.0f} s budget"
                 f"{' (--quick: tiny models)' if e['quick'] else ''}. Random weights of the exact configs; nothing "
                 "downloaded. Acceptance of random weights means nothing; costs, numerics and code paths do.", ""]
        if self.skipped:
            lines += ["Not measured: " + "; ".join(self.skipped) + ".", ""]
        for name, trace in self.failures:
            lines += [f"## FAILED: {name}", "", "```", trace.rstrip(), "```", ""]
        if self.profile:
            lines += ["## Cost profile: embedded pair", "", *_ms_table("target verification ms, tree size",
                                                                      self.profile["verify_ms"]),
                      "", *_ms_table("middle drafting pass ms (int8 where faster, top-k over the draft vocabulary), tokens", self.profile["middle_ms"]), "",
                      f"n-gram step {self.profile['ngram_ms']:.3f} ms, scheduler call {self.profile['scheduler_ms']:.3f} ms "
                      f"(host); cache of {self.profile['past']} tokens behind every pass.", ""]
        if rounds:
            head = (["method", "tok/s", "ms/round"] + [f"{p} ms/round" for p in PHASES if p != "prefill"]
                    + ["profile's verify ms at the mean tree size", "accepted/round", "mid calls/round",
                       "exact/near-tie/mismatch"])
            lines += [f"## End to end: embedded pair, budget {BUDGET}", "", "| " + " | ".join(head) + " |",
                      "|---" * len(head) + "|"]
            cost = CostModel.from_dict(self.profile)
            for m, r in rounds.items():
                v = {k: sum(x["verdict"] == k for x in self.runs if x["method"] == m) for k in VERDICTS}
                lines.append(f"| {m} | {r['tokens_per_s']:.2f} | {r['ms_per_round']:.1f} | "
                             + " | ".join(f"{ms:.1f}" for ms in r["phases_ms_per_round"].values())
                             + f" | {cost.verify(r['mean_tree_size']):.1f} | {r['accepted_per_round']:.2f} | "
                               f"{r['middle_calls_per_round']:.2f} | {'/'.join(str(x) for x in v.values())} |")
            counts = self.verdicts()
            lines += ["", f"Lossless check against ar (lossless.classify): {counts['exact']} exact, "
                          f"{counts['near-tie']} near-tie, {counts['mismatch']} mismatch."]
            lines += [f"- {r['verdict']}: {r['method']} on prompt {r['prompt']}: {r['reason']}"
                      for r in self.runs if r["verdict"] != "exact"]
            if self.sampled:
                lines.append(f"\nSampling: {self.sampled['method']} at temperature {self.sampled['temperature']}, seed 0, "
                             f"twice: {'the same tokens' if self.sampled['repeats'] else 'DIFFERENT tokens'}.")
            lines.append("")
        if self.proxy:
            p = self.proxy
            lines += [f"## {PROXY_NAME}", "", p["note"], ""]
            for layers, ms in p["verify_ms_measured"].items():
                lines += _ms_table(f"verification ms, {layers} layers", ms)
                lines.append("")
            lines += [*_ms_table(f"verification ms, scaled to {p['layers']} layers", p["verify_ms"]), "",
                      *_ms_table("1B middle drafting pass ms, tokens", p["middle_ms"]), ""]
        if self.memory:
            lines += ["## Peak GPU memory", "", "| stage | GiB |", "|---|---|",
                      *(f"| {k} | {v:.2f} |" for k, v in self.memory.items()), ""]
        lines += ["Projected speedups from this profile: `treegraft project --profile "
                  f"{self.out / 'profile.json'} --out {self.out / 'project'}`.", ""]
        return "\n".join(lines)


def _ms_table(label: str, values: dict) -> list[str]:
    keys = list(values)
    return [f"| {label} | " + " | ".join(str(k) for k in keys) + " |", "|---" * (len(keys) + 1) + "|",
            "| ms | " + " | ".join(f"{values[k]:.2f}" for k in keys) + " |"]


def parse_layers(text: str) -> tuple[int, int]:
    try:
        l1, l2 = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--proxy-layers takes two layer counts L1,L2, got {text!r}") from None
    if not 1 <= l1 < l2:
        raise argparse.ArgumentTypeError(f"--proxy-layers needs 1 <= L1 < L2, got {text!r}")
    return l1, l2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu (default %(default)s)")
    p.add_argument("--out", required=True, help="folder for profile.json and report.md")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="(default %(default)s)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S,
                   help="seconds for all stages (default %(default)s); what does not fit is skipped and said so")
    p.add_argument("--proxy-layers", type=parse_layers, default=PROXY_LAYERS,
                   help="decoder layers L1,L2 of the two 70B proxies (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny models and sizes: the same stages in seconds")
    args = p.parse_args(argv)
    try:
        device = pick_device(args.device)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    check = Check(args, device, DTYPES[args.dtype], QUICK if args.quick else FULL)
    check.stage("embedded pair: cost profile", check.embedded_profile)
    if check.profile:
        check.stage("embedded pair: end to end", check.end_to_end)
    check.stage("70B proxy: cost profile", check.proxy_profile)
    counts = check.verdicts()
    print(f"{check.out / 'profile.json'}\n{check.out / 'report.md'}\n"
          f"{counts['exact']} exact, {counts['near-tie']} near-tie, {counts[MISMATCH]} mismatch"
          + (f"; not measured: {'; '.join(check.skipped)}" if check.skipped else ""))
    if check.failures:
        print(f"FAILED: {', '.join(name for name, _ in check.failures)} (tracebacks in the report)", file=sys.stderr)
    return 1 if counts[MISMATCH] or check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
