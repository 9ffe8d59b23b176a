"""A request's start and finish (request.py), with stand-in drafters and a stand-in prefill: no model."""

import numpy as np
import pytest

from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.request import DeepeningCalibration, finish_request, start_request
from treegraft_dist.decoding.schedule import ShallowTreeHeuristic, fixed_schedule
from treegraft_dist.decoding.signals import Timings, context_signals
from treegraft_dist.decoding.tree import ORIGIN_MIDDLE, ORIGIN_NGRAM

PROMPT = [5, 6, 7, 5, 6]
FIRST = 9


class Recording:
    """A drafter that records what it is told (and proposes nothing)."""

    alive = True
    fallback_steps = 0

    def __init__(self, origin: int, fail_start: bool = False):
        self.origin, self.fail_start = origin, fail_start
        self.calls: list[tuple] = []

    def start(self, prompt, prefill):
        self.calls.append(("start", list(prompt), prefill))
        if self.fail_start:
            raise RuntimeError("the drafter could not start")

    def step(self, tree, frontier, layer):
        raise AssertionError("no round is drafted here")

    def accept(self, path, tokens):
        self.calls.append(("accept", list(path), list(tokens)))

    def release(self):
        self.calls.append(("release",))


def start(max_new: int, drafters, method: str = "all-mid", cfg: TreeConfig = TreeConfig(), **kw):
    cache = object()  # what the prefill hands the drafters, whatever it is
    req = start_request(PROMPT, max_new, {2}, fixed_schedule(method, cfg.depth), cfg,
                        timings=lambda: Timings(100.0, 25.0), prefill=lambda p: (FIRST, cache),
                        drafters=lambda r: drafters, **kw)
    return req, cache


def test_a_request_hands_its_prefill_to_its_drafters_and_releases_them_as_it_finishes():
    ngram, middle = Recording(ORIGIN_NGRAM), Recording(ORIGIN_MIDDLE)
    req, cache = start(10, (ngram, middle))
    assert req.first == FIRST and req.drafters == [ngram, middle]
    assert "prefill" in req.stats.seconds and req.stats.prompt_tokens == len(PROMPT)
    for d in (ngram, middle):
        assert d.calls == [("start", PROMPT, cache), ("accept", [], [FIRST])]
    req.stats.accepted.append(3)
    got = finish_request(req, [FIRST, 4, 2, 8])  # cut after the end of sequence, as plain decoding stops
    assert got.tokens == [FIRST, 4, 2] and got.stats is req.stats
    assert (got.stats.new_tokens, got.stats.rounds) == (3, 1) and got.stats.wall_s > 0
    assert ngram.calls[-1] == middle.calls[-1] == ("release",)


def test_a_request_for_no_tokens_never_reaches_the_target_nor_the_drafters():
    req = start_request(PROMPT, 0, set(), fixed_schedule("all-small", 5), TreeConfig(),
                        timings=lambda: 1 / 0, prefill=lambda p: 1 / 0, drafters=lambda r: 1 / 0)
    assert req.first is None and req.drafters == []
    assert finish_request(req, []).tokens == []


def test_the_drafters_are_released_when_one_cannot_start():
    ngram, middle = Recording(ORIGIN_NGRAM), Recording(ORIGIN_MIDDLE, fail_start=True)
    with pytest.raises(RuntimeError, match="could not start"):
        start(10, (ngram, middle))
    assert ngram.calls[-1] == middle.calls[-1] == ("release",)


def test_the_round_settings_and_context_come_from_the_engines_settings_and_timings():
    calibration = DeepeningCalibration()
    req, _ = start(10, (Recording(ORIGIN_NGRAM), None), cfg=TreeConfig(deepen=2), calibration=calibration)
    assert req.cfg.deepen_cost == 0.25 and req.context is None  # a fixed schedule reads no signals
    req.stats.deep_expected, req.stats.deep_accepted = 4.0, 1.0
    finish_request(req, [FIRST])
    assert (calibration.expected, calibration.accepted) == (4.0, 1.0)  # later requests price deepening by it
    heuristic = start_request(PROMPT, 10, set(), ShallowTreeHeuristic(), TreeConfig(),
                              timings=lambda: Timings(100.0, 25.0), prefill=lambda p: (FIRST, None),
                              drafters=lambda r: (Recording(ORIGIN_NGRAM), None))
    np.testing.assert_allclose(heuristic.context, context_signals(len(PROMPT), Timings(100.0, 25.0)))
