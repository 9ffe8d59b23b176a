"""Other planner inputs than the recorded signals: the longest earlier match of a context's suffix, and rounds
whose device-constant signals are replaced while everything else stays as collected."""

import numpy as np

from treegraft_dist.scheduling.collect import read_trajectories
from treegraft_dist.scheduling.device import SHIPPED_TRAJECTORIES
from treegraft_dist.scheduling.inputs import longest_match, with_root

DATA = next(iter(SHIPPED_TRAJECTORIES.values()))


def test_root_signals_replace_only_the_device_constant_inputs():
    assert longest_match([1, 2, 3, 9, 1, 2, 3]) == 3  # "1 2 3" occurred before
    assert longest_match([1, 2, 3, 4]) == 0
    assert longest_match([5, 5, 5, 5, 5], cap=2) == 2
    rounds = read_trajectories(DATA).rounds(4)
    features = np.random.default_rng(0).random((len(rounds), 3))
    view = with_root(rounds, features)
    assert np.allclose(view.signals[:, 7, 1:4], features.astype(np.float32))  # every prefix state of a round
    untouched = [0] + list(range(4, view.signals.shape[2]))
    assert np.array_equal(view.signals[:, :, untouched], rounds.signals[:, :, untouched])
    assert np.array_equal(view.accepted, rounds.accepted) and np.array_equal(view.latency_ms, rounds.latency_ms)
