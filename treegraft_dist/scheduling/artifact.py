"""The scheduler artifact on disk: the distilled scheduler and, beside it, the value heads it was distilled
from (value-planner runs them), in one .npz file written atomically (decoding.scheduler checks the
scheduler's part, this module the value heads').

The value heads travel as extra arrays of LearnedScheduler.save:
  value.mean [17] float32, value.std [17] float32, value.target_norm [4, 2] float64 ((mean, std) per
  head, rows in HEADS order), value.<head>.<layer> (torch names: 0.weight [hidden, 17 + 2D], 0.bias,
  2.weight [hidden, hidden], 2.bias, 4.weight [1, hidden], 4.bias [1]) float32;
and as metadata {"value": {"subset": [...], "hidden": int, "heads": HEADS}}.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..decoding.scheduler import LearnedScheduler, SchedulerArtifactError
from ..decoding.signals import NUM_SIGNALS, SIGNAL_NAMES
from .value import HEADS, SUFFIX_WIDTH, ValueHeads


def _value_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """Artifact key -> shape of every value-head array."""
    net = {"0.weight": (hidden, NUM_SIGNALS + SUFFIX_WIDTH), "0.bias": (hidden,), "2.weight": (hidden, hidden),
           "2.bias": (hidden,), "4.weight": (1, hidden), "4.bias": (1,)}
    shapes = {"value.mean": (NUM_SIGNALS,), "value.std": (NUM_SIGNALS,), "value.target_norm": (len(HEADS), 2)}
    shapes.update({f"value.{h}.{name}": shape for h in HEADS for name, shape in net.items()})
    return shapes


def _heads_arrays(heads: ValueHeads) -> tuple[dict[str, np.ndarray], dict]:
    if set(heads.nets) != set(HEADS) or set(heads.target_norm) != set(HEADS):
        raise ValueError(f"value heads need a net and a target normalisation for each of {HEADS}, got nets "
                         f"{sorted(heads.nets)} and target_norm {sorted(heads.target_norm)}: fit them with "
                         "fit_value_heads")
    hidden = heads.hidden
    arrays = {"value.mean": np.asarray(heads.mean, np.float32), "value.std": np.asarray(heads.std, np.float32),
              "value.target_norm": np.array([heads.target_norm[h] for h in HEADS], np.float64)}
    for h in HEADS:
        for name, tensor in heads.nets[h].state_dict().items():
            arrays[f"value.{h}.{name}"] = tensor.detach().cpu().numpy().astype(np.float32)
    expected = _value_shapes(hidden)
    wrong = [f"{k} {arrays[k].shape if k in arrays else 'missing'} (expected {expected.get(k, 'no such array')})"
             for k in sorted(set(expected) | set(arrays)) if k not in arrays or arrays[k].shape != expected.get(k)]
    if wrong:
        raise ValueError(f"value heads do not have the layout fit_value_heads builds "
                         f"({NUM_SIGNALS + SUFFIX_WIDTH} -> {hidden} -> {hidden} -> 1 per head, mean and std "
                         f"[{NUM_SIGNALS}]): {'; '.join(wrong)}")
    return arrays, {"subset": list(heads.subset), "hidden": hidden, "heads": list(HEADS)}


def _heads_from_artifact(arrays: dict[str, np.ndarray], meta: dict, where: str) -> ValueHeads | None:
    """The value heads an artifact carries (None when it carries none); SchedulerArtifactError when damaged."""
    value_meta = meta.get("value")
    if value_meta is None and not any(k.startswith("value.") for k in arrays):
        return None

    def damaged(what: str) -> SchedulerArtifactError:
        return SchedulerArtifactError(f"{where} has a damaged value-head part: {what}; write it again with "
                                      "scheduling.artifact.save_artifact, or refit the value heads")

    if not isinstance(value_meta, dict):
        raise damaged(f"value-head arrays but metadata {value_meta!r} instead of a JSON object")
    subset, hidden = value_meta.get("subset"), value_meta.get("hidden")
    if not isinstance(subset, list) or not subset or not set(subset) <= set(SIGNAL_NAMES):
        raise damaged(f"the signal subset {subset!r} is not a non-empty subset of the {NUM_SIGNALS} signals")
    if type(hidden) is not int or hidden < 1:
        raise damaged(f"the hidden size {hidden!r} is not a positive integer")
    if value_meta.get("heads") != list(HEADS):
        raise damaged(f"the heads {value_meta.get('heads')!r} are not {list(HEADS)}")
    expected = _value_shapes(hidden)
    wrong = [f"{k} {arrays[k].shape if k in arrays else 'missing'} (expected {shape})"
             for k, shape in expected.items() if k not in arrays or arrays[k].shape != shape]
    wrong += [f"{k} holds {arrays[k].dtype}, not floats" for k in expected
              if k in arrays and arrays[k].dtype.kind != "f"]
    if wrong:
        raise damaged(f"arrays missing, of the wrong shape or type for hidden size {hidden}: {'; '.join(wrong)}")
    bad = [k for k in expected if not np.isfinite(arrays[k]).all()]
    bad += ["value.std <= 0"] if (arrays["value.std"] <= 0).any() else []
    bad += ["value.target_norm std <= 0"] if (arrays["value.target_norm"][:, 1] <= 0).any() else []
    if bad:
        raise damaged(f"non-finite or invalid values ({', '.join(bad)})")
    with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: leave the global RNG be
        heads = ValueHeads.untrained(subset, np.array(arrays["value.mean"], np.float32),
                                     np.array(arrays["value.std"], np.float32), hidden)
    for i, h in enumerate(HEADS):
        heads.nets[h].load_state_dict({name: torch.from_numpy(np.array(arrays[f"value.{h}.{name}"], np.float32))
                                       for name in heads.nets[h].state_dict()})
        heads.target_norm[h] = (float(arrays["value.target_norm"][i, 0]), float(arrays["value.target_norm"][i, 1]))
    return heads


def save_artifact(path: str | Path, scheduler: LearnedScheduler, heads: ValueHeads | None) -> Path:
    """Write the scheduler's artifact (atomically, as LearnedScheduler.save) with the value heads in the same
    file; heads=None writes the scheduler alone."""
    if heads is None:
        return scheduler.save(path, extra_arrays={}, extra_meta={})
    arrays, meta = _heads_arrays(heads)
    return scheduler.save(path, extra_arrays=arrays, extra_meta={"value": meta})


def load_artifact(path: str | Path, expect_pair: tuple[str, str] | None = None
                  ) -> tuple[LearnedScheduler, ValueHeads | None]:
    """Read an artifact: the scheduler (checked as LearnedScheduler.load checks it) and the value heads it
    carries, or None. A damaged value-head part raises SchedulerArtifactError."""
    path = Path(path)
    scheduler = LearnedScheduler.load(path, expect_pair)
    where = f"scheduler artifact {str(path)!r}"
    return scheduler, _heads_from_artifact(scheduler.extra_arrays, scheduler.extra_meta, where)
