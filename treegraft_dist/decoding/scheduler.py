"""The learned scheduler: a 3,265-parameter MLP reads the 17 signals before a drafting layer and says
whether calling the middle drafter pays (margin > 0) or an n-gram step does.

It is fitted offline (scheduling/value.py, fit.py; for the device it runs on, scheduling/device.py) and kept as one
artifact file: weights, the z-score normalisation, the signal subset it was fitted on, the device cost
profile and model pair it belongs to, the data split and the versions that wrote it; optionally also the
value heads it was distilled from (written and read by scheduling.artifact.save_artifact / load_artifact). At run
time the forward is a few float32 numpy products on a [17] vector with the normalisation folded into the
first layer: no torch, no autograd.

The network always takes all 17 signals; signals outside the fitted subset are multiplied by 0 after
z-scoring (the `mask` buffer), so a model fitted without the raw millisecond timings cannot read them on
another device.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from ..files import write_bytes
from .signals import NUM_SIGNALS, SIGNAL_NAMES

FORMAT_VERSION = 1
HIDDEN = (64, 32)
# Layer names and shapes as torch stores them: weight [out, in], bias [out].
LAYER_SHAPES = {
    "w1": (HIDDEN[0], NUM_SIGNALS), "b1": (HIDDEN[0],),
    "w2": (HIDDEN[1], HIDDEN[0]), "b2": (HIDDEN[1],),
    "w3": (1, HIDDEN[1]), "b3": (1,),
}
_TORCH_NAMES = {"w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias", "w3": "4.weight",
                "b3": "4.bias"}  # in SchedulerMLP.net
_META_KEY = "meta_json"


class SchedulerArtifactError(ValueError):
    """A scheduler artifact that cannot be used here; the message says what is wrong and what to do."""


def subset_mask(subset) -> np.ndarray:  # [17] float32, 1 for a signal in the subset
    unknown = [s for s in subset if s not in SIGNAL_NAMES]
    if unknown:
        raise ValueError(f"unknown signals {unknown}: choose from {', '.join(SIGNAL_NAMES)}")
    return np.array([name in subset for name in SIGNAL_NAMES], np.float32)


class SchedulerMLP(torch.nn.Module):
    """z-score (masked to the fitted subset) -> 17 -> 64 -> 32 -> 1 with ReLU; output = margin.
    `mean`, `std`: [17]."""

    def __init__(self, subset=SIGNAL_NAMES, mean: np.ndarray | None = None, std: np.ndarray | None = None):
        super().__init__()
        self.register_buffer("mean", torch.zeros(NUM_SIGNALS) if mean is None else torch.as_tensor(mean).float())
        self.register_buffer("std", torch.ones(NUM_SIGNALS) if std is None else torch.as_tensor(std).float())
        self.register_buffer("mask", torch.from_numpy(subset_mask(subset)))
        self.net = torch.nn.Sequential(
            torch.nn.Linear(NUM_SIGNALS, HIDDEN[0]), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN[0], HIDDEN[1]), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN[1], 1),
        )

    @property
    def subset(self) -> tuple[str, ...]:
        return tuple(n for n, m in zip(SIGNAL_NAMES, self.mask.tolist()) if m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, 17] -> [n] margins
        return self.net((x - self.mean) / self.std * self.mask).squeeze(-1)

    def arrays(self) -> dict[str, np.ndarray]:
        """Weights in torch layout (w1 [64, 17], ...) plus mean and std, as float32 numpy arrays."""
        state = self.net.state_dict()
        out = {k: state[t].detach().cpu().numpy().astype(np.float32) for k, t in _TORCH_NAMES.items()}
        out["mean"] = self.mean.cpu().numpy().astype(np.float32)
        out["std"] = self.std.cpu().numpy().astype(np.float32)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], subset) -> "SchedulerMLP":
        model = cls(subset, arrays["mean"], arrays["std"])
        model.net.load_state_dict({t: torch.from_numpy(np.asarray(arrays[k], np.float32).copy())
                                   for k, t in _TORCH_NAMES.items()})
        return model.eval()


@dataclass(frozen=True)
class SchedulerInfo:
    """What an artifact records besides the weights.

    pair          (target id, middle id) the trajectories were collected with
    cost_profile  measured costs the latencies came from, e.g. {"device": ..., "ngram_ms": 0.9,
                  "middle_ms": {tokens: ms}, "verify_ms": {tree size: ms}}
    split         data split, e.g. {"train": [prompt ids], "heldout": [...], "benchmarks": [...]}
    fit           anything about the fit worth keeping (seed, chosen subset's held-out errors, ...)
    """

    pair: tuple[str, str]
    cost_profile: dict = field(default_factory=dict)
    split: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)


def versions() -> dict[str, str]:
    try:
        package = metadata.version("treegraft-dist")
    except metadata.PackageNotFoundError:
        package = "unknown"
    return {"format": str(FORMAT_VERSION), "treegraft_dist": package, "torch": torch.__version__,
            "numpy": np.__version__}


class LearnedScheduler:
    """The `treegraft` schedule policy: call the middle drafter at a layer iff the MLP's margin > 0.

    The engine applies the per-round call budget on top of the decision. Not thread-safe (the forward
    writes into preallocated buffers): use one instance per thread.
    """

    name = "treegraft"
    needs_signals = True
    budgeted = True  # the engine caps its middle calls a round: call_cap_at, else b0 = floor(T_tgt / T_mid)
    stateless = True
    # A round whose text is copying a span (NGramDrafter.copying) drafts its first layer with the n-gram
    # drafter whatever the margin: the signals do not show a match, and a middle layer first would rank its
    # guesses above the copy.
    copies_first = True

    def __init__(self, model: SchedulerMLP, info: SchedulerInfo):
        self.model = model.eval()
        self.info = info
        a = model.arrays()
        scale = model.mask.numpy() / a["std"]  # [17]
        # (x - mean) * scale @ w1.T + b1  ==  x @ w1f + b1f
        self._w1 = np.ascontiguousarray(scale[:, None] * a["w1"].T, np.float32)  # [17, 64]
        self._b1 = (a["b1"] - (a["mean"] * scale) @ a["w1"].T).astype(np.float32)  # [64]
        self._w2 = np.ascontiguousarray(a["w2"].T)  # [64, 32]
        self._b2 = a["b2"]  # [32]
        self._w3 = np.ascontiguousarray(a["w3"][0])  # [32]
        self._b3 = float(a["b3"][0])
        self._h1 = np.empty(HIDDEN[0], np.float32)
        self._h2 = np.empty(HIDDEN[1], np.float32)
        # What the artifact carries besides the scheduler (scheduling.artifact.save_artifact puts the value heads here).
        self.extra_arrays: dict[str, np.ndarray] = {}
        self.extra_meta: dict = {}

    def __setstate__(self, state: dict) -> None:
        # Arrays that arrive through Ray's object store are read-only views of it: the forward's buffers
        # must be this instance's own.
        self.__dict__.update(state)
        self._h1, self._h2 = np.empty_like(self._h1), np.empty_like(self._h2)

    @property
    def width(self) -> int | None:
        """The tree width (TreeConfig.top_k) of the trajectories it was fitted on, where recorded: the width
        its budget and call cap were chosen for (scheduling.device.choose_width)."""
        w = (self.info.fit.get("tree") or {}).get("top_k")
        return None if w is None else int(w)

    def call_cap_at(self, budget: int) -> int | None:
        """The per-round call cap this scheduler was fitted with, where it runs at the budget it was fitted
        for (None otherwise, or for an artifact that records none). Its margins assume exactly that cap: the
        engine applies it rather than one it times itself, which a busy moment can halve."""
        profile = self.info.cost_profile
        if profile.get("call_cap") is None or profile.get("budget") != budget:
            return None
        return int(profile["call_cap"])

    @property
    def subset(self) -> tuple[str, ...]:
        return self.model.subset

    def margin(self, signals: np.ndarray) -> float:  # signals: [17] float32
        h1, h2 = self._h1, self._h2
        np.dot(signals, self._w1, out=h1)
        h1 += self._b1
        np.maximum(h1, 0.0, out=h1)
        np.dot(h1, self._w2, out=h2)
        h2 += self._b2
        np.maximum(h2, 0.0, out=h2)
        return float(np.dot(h2, self._w3)) + self._b3

    def decide(self, signals: np.ndarray, layer: int) -> bool:  # signals: [17]
        if signals.dtype != np.float32:
            signals = signals.astype(np.float32)
        return self.margin(signals) > 0.0

    # -- the artifact ---------------------------------------------------------------------------------
    def save(self, path: str | Path, extra_arrays: dict[str, np.ndarray] | None = None,
             extra_meta: dict | None = None) -> Path:
        """Write the artifact (.npz) atomically: a temporary file in the same folder, then a rename.

        `extra_arrays` (keys other than the scheduler's own) and `extra_meta` (JSON-serialisable) travel
        in the same file for other readers; they default to this instance's `extra_arrays` / `extra_meta`
        (what `load` found), so an artifact saved again keeps them."""
        path = Path(path)
        arrays = self.model.arrays()
        extra_arrays = self.extra_arrays if extra_arrays is None else extra_arrays
        extra_meta = self.extra_meta if extra_meta is None else extra_meta
        clash = sorted(set(extra_arrays) & (set(arrays) | {_META_KEY}))
        if clash:
            raise ValueError(f"extra arrays {clash} would overwrite the scheduler's own keys: give them a "
                             "prefix such as 'value.'")
        meta = {"format_version": FORMAT_VERSION, "signal_names": list(SIGNAL_NAMES),
                "subset": list(self.subset), "pair": list(self.info.pair),
                "cost_profile": self.info.cost_profile, "split": self.info.split, "fit": self.info.fit,
                "versions": versions(), "extra": dict(extra_meta)}
        buf = io.BytesIO()
        np.savez(buf, **arrays, **extra_arrays, **{_META_KEY: np.array(json.dumps(meta))})
        write_bytes(path, buf.getvalue())
        return path

    @classmethod
    def load(cls, path: str | Path, expect_pair: tuple[str, str] | None = None) -> "LearnedScheduler":
        """Read an artifact written by `save`; refuse (SchedulerArtifactError) one that does not fit this
        package or, when `expect_pair` = (target id, middle id) is given, another model pair. Arrays and
        metadata beyond the scheduler's are kept, unchecked, as `extra_arrays` and `extra_meta`."""
        path = Path(path)
        arrays, meta = _read(path)
        where = f"scheduler artifact {str(path)!r}"
        if meta.get("format_version") != FORMAT_VERSION:
            raise SchedulerArtifactError(
                f"{where} has format version {meta.get('format_version')!r}, this package reads "
                f"{FORMAT_VERSION}: refit the scheduler with this version of treegraft-dist")
        names = meta.get("signal_names")
        if names != list(SIGNAL_NAMES):
            count = len(names) if isinstance(names, list) else "an unknown number of"
            raise SchedulerArtifactError(
                f"{where} was fitted on {count} signals {names} but this package computes {NUM_SIGNALS} "
                f"({', '.join(SIGNAL_NAMES)}): refit the scheduler on trajectories collected with this version")
        subset = meta.get("subset")
        if not isinstance(subset, list) or not subset or not set(subset) <= set(SIGNAL_NAMES):
            raise SchedulerArtifactError(
                f"{where} records the signal subset {subset!r}, which is not a non-empty subset of the "
                f"{NUM_SIGNALS} signals: the file was not written by LearnedScheduler.save; refit it")
        expected = {**LAYER_SHAPES, "mean": (NUM_SIGNALS,), "std": (NUM_SIGNALS,)}
        wrong = [f"{k} {arrays[k].shape if k in arrays else 'missing'} (expected {shape})"
                 for k, shape in expected.items() if k not in arrays or arrays[k].shape != shape]
        if wrong:
            raise SchedulerArtifactError(
                f"{where} has parameters of the wrong shape: {'; '.join(wrong)}; the scheduler is "
                f"17 -> 64 -> 32 -> 1: refit it with this version of treegraft-dist")
        bad = [k for k in expected if not np.isfinite(arrays[k]).all()] + (
            ["std <= 0"] if (arrays["std"] <= 0).any() else [])
        if bad:
            raise SchedulerArtifactError(f"{where} holds non-finite or invalid values ({', '.join(bad)}): "
                                         "the fit diverged or the file is damaged; refit the scheduler")
        pair = tuple(meta.get("pair") or ())
        if expect_pair is not None and pair != tuple(expect_pair):
            raise SchedulerArtifactError(
                f"{where} was fitted for target/middle pair {pair}, not {tuple(expect_pair)}: use the "
                "artifact fitted for this pair, or collect trajectories and fit one for it")
        extra_meta = meta.get("extra", {})
        if not isinstance(extra_meta, dict):
            raise SchedulerArtifactError(f"{where} records extra metadata {extra_meta!r}, not a JSON object: "
                                         "the file was not written by LearnedScheduler.save; write it again")
        info = SchedulerInfo(pair, meta.get("cost_profile", {}), meta.get("split", {}), meta.get("fit", {}))
        scheduler = cls(SchedulerMLP.from_arrays(arrays, subset), info)
        scheduler.extra_arrays = {k: v for k, v in arrays.items() if k not in expected}
        scheduler.extra_meta = extra_meta
        return scheduler


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    if not path.is_file():
        raise SchedulerArtifactError(f"scheduler artifact {str(path)!r} does not exist: pass the .npz file "
                                     "that LearnedScheduler.save wrote")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop(_META_KEY)))
        if not isinstance(meta, dict):
            raise ValueError("metadata is not a JSON object")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise SchedulerArtifactError(
            f"scheduler artifact {str(path)!r} is corrupt or not a scheduler artifact "
            f"({type(e).__name__}: {e}): write it again with LearnedScheduler.save") from e
    return arrays, meta


def fitted_tree(cfg, policy, budget: bool = True, width: bool = True):
    """`cfg` (a TreeConfig) with the tree size (`budget`) and width (`width`) that the learned scheduler `policy`
    was fitted for, where it records them; unchanged for any other policy."""
    info = getattr(policy, "info", None)
    if info is None:
        return cfg
    changes = {}
    if budget and info.cost_profile.get("budget") is not None:
        changes["budget"] = int(info.cost_profile["budget"])
    if width and getattr(policy, "width", None) is not None:
        changes["top_k"] = policy.width
    return dataclasses.replace(cfg, **changes)
