"""The evaluation's method registry: which names `--methods` takes and what each one runs.

  ar                      plain greedy decoding with the target alone: the reference every output is checked
                          against (decoding.engine.AR_METHOD);
  all-small, all-mid      fixed schedules (the n-gram drafter, or the middle drafter, at every layer); a 5-bit
                          pattern such as 01001 is any other fixed schedule;
  treegraft               the learned scheduler fitted for this device (decoding.scheduler);
  value-planner, oracle   for studying the scheduler: the value heads planning online, and the best schedule
                          of every round in hindsight (enumerated before its timed decode);
  hf-assisted, hf-pld     the peers, run by transformers' own `generate` (peers.py).

Suffixes: a fixed schedule or treegraft with @published runs the published tree settings (depth 5, no long
n-gram chains, no deepening), with @shallow only without deepening (config.TreeConfig.deepen), with @unpinned
without pinning a copy's chain ahead of the nodes ranked by score (config.TreeConfig.pin_match), with @capped
never past its budget (a copied span the budget cuts short is otherwise verified further where that pays:
sizing.CopyReach); a fixed schedule or treegraft with @sized sizes every round's tree from calibrated acceptance
and this device's costs; treegraft@paced drafts only while drafting pays for the request (as the server runs a
request alone), where treegraft drafts every round;
@kN (treegraft@k4, all-mid@k10@sized) grows trees of width N instead of the method's own; @deepN (treegraft@deep4)
may draft up to N middle layers past the depth where one more is expected to pay (config.TreeConfig.deepen).
"""

from __future__ import annotations

import re

from ..decoding.engine import AR_METHOD
from ..decoding.schedule import NAMED_SCHEDULES
from .peers import PEER_METHODS

TREEGRAFT = "treegraft"
VALUE_PLANNER = "value-planner"
ORACLE = "oracle"
OUR_FIXED = tuple(NAMED_SCHEDULES)
DEFAULT_METHODS = (AR_METHOD, "all-small", "all-mid", TREEGRAFT) + PEER_METHODS
# Methods read from a scheduler artifact; value-planner and oracle are for studying the scheduler (the
# oracle enumerates all 32 schedules of every round before its timed decode), so not in the default list.
ARTIFACT_METHODS = (TREEGRAFT, VALUE_PLANNER, ORACLE)
ALL_METHODS = DEFAULT_METHODS + (VALUE_PLANNER, ORACLE)

# A fixed schedule with this suffix (all-small@published) runs with the published tree settings: no long
# n-gram chains (config.py), so one run compares the extension with the paper's settings side by side.
PUBLISHED = "@published"

# A fixed schedule or treegraft with this suffix never drafts past its depth (deepen = 0; TreeConfig's default is 4:
# see engine.deepening).
SHALLOW = "@shallow"

# A fixed schedule or treegraft with this suffix prunes a copy's long chain by score like any other node
# (pin_match = 0; by default a long chain behind a match of 2 tokens or more is verified first: ngram.py).
UNPINNED = "@unpinned"

# A fixed schedule or treegraft with this suffix never verifies more than its budget: a copied span the budget cuts
# short is not verified further (sizing.CopyReach, on by default), so one run compares the two side by side.
CAPPED = "@capped"


# A fixed schedule or treegraft with this suffix (all-small@sized, all-small@published@sized, treegraft@sized)
# sizes every round's tree from calibrated acceptance and this device's verification costs (sizing.py) instead
# of pruning to its budget (plain treegraft: the budget its scheduler was fitted for).
SIZED = "@sized"

# A fixed schedule or treegraft with this suffix and a number (treegraft@k4, all-mid@k4@sized) grows trees of that
# width K (children per node, frontier size) instead of its own: treegraft's is the width its scheduler was fitted
# for (scheduling.device.choose_width), a fixed schedule's the published 10. One run compares widths side by side.
WIDTH = "@k"

# A fixed schedule or treegraft with this suffix and a number (treegraft@deep4) may draft up to that many middle
# layers past its depth while one more is expected to pay for its call (engine.deepening; TreeConfig.deepen, 4 by
# default): one run compares deepening with the default side by side.
DEEP = "@deep"
_SETTINGS_RE = re.compile(r"@(k|deep)(\d+)")

# treegraft with this suffix drafts only while drafting pays for the request (sizing.Payoff: plain steps and
# cheap exploring rounds where it does not), as the server runs a request alone; side by side with treegraft.
PACED = "@paced"


def _setting(m: str, name: str) -> int | None:
    found = [int(n) for k, n in _SETTINGS_RE.findall(m) if k == name]
    return found[0] if found else None


def width_of(m: str) -> int | None:
    """The tree width a method name asks for with @kN, else None."""
    return _setting(m, "k")


def deepen_of(m: str) -> int | None:
    """The deepening layers a method name asks for with @deepN, else None."""
    return _setting(m, "deep")


def without_settings(m: str) -> str:
    """The name without its numbered suffixes (@kN, @deepN)."""
    return _SETTINGS_RE.sub("", m)


def artifact_base(m: str) -> str | None:
    """The artifact method (treegraft, value-planner, oracle) a name runs, with @sized or @paced for treegraft;
    else None."""
    m = without_settings(m)
    if m in ARTIFACT_METHODS:
        return m
    tags = (SIZED, PACED, SHALLOW, PUBLISHED, UNPINNED, CAPPED)
    return TREEGRAFT if m in tuple(TREEGRAFT + tag for tag in tags) else None


def fixed_base(m: str) -> str | None:
    """The schedule of a fixed method (all-small, all-mid, a pattern, optionally @published, @shallow or @unpinned, then
    @sized), else None."""
    base = without_settings(m).removesuffix(SIZED)
    for tag in (PUBLISHED, SHALLOW, UNPINNED, CAPPED):
        base = base.removesuffix(tag)
    return base if base in OUR_FIXED or re.fullmatch(r"[01]+", base) else None


def is_method(m: str) -> bool:
    settings = _SETTINGS_RE.findall(m)
    names = [k for k, _ in settings]
    if len(set(names)) < len(names) or any(k == "k" and int(n) < 1 for k, n in settings):
        return False
    return m in ALL_METHODS or fixed_base(m) is not None or artifact_base(m) is not None


def is_sized(m: str) -> bool:
    return without_settings(m).endswith(SIZED) and (fixed_base(m) is not None or artifact_base(m) is not None)


def is_ours(m: str) -> bool:
    """Methods whose outputs must equal `ar` (a mismatch fails the run); peers are only reported."""
    return m not in PEER_METHODS
