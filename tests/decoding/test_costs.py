"""Cost profiles: what a sweep over block sizes keeps when the machine is noisy."""

from treegraft_dist.decoding.costs import PROFILE_SWEEPS, check_sizes, swept_profile


def sweep(costs: dict[int, float], burst_at: int | None = None):
    """A measure function returning `costs[b]`, except that call number `burst_at` is 1000x slower."""
    calls = []

    def measure(b: int) -> float:
        calls.append(b)
        return costs[b] * (1e3 if len(calls) == burst_at else 1.0)

    return measure, calls


def test_a_burst_during_one_sweep_does_not_stay_in_the_profile():
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0}
    for call in range(1, len(costs) + 1):  # a burst at each size of the first sweep
        measure, calls = sweep(costs, burst_at=call)
        assert swept_profile(measure, tuple(costs), "test") == costs
        assert len(calls) == PROFILE_SWEEPS * len(costs)


def test_a_sweep_stops_at_a_size_that_costs_too_many_single_passes():
    costs = {1: 10.0, 2: 12.0, 4: 50.0, 8: 60.0}
    measure, calls = sweep(costs)
    assert swept_profile(measure, tuple(costs), "test", stop_ratio=4.0) == {1: 10.0, 2: 12.0}
    assert 8 not in calls  # nothing past the first size over the ratio is measured


def test_a_bigger_block_never_costs_less_in_a_profile():
    measure, _ = sweep({1: 10.0, 2: 9.0, 4: 14.0, 8: 12.0})
    assert swept_profile(measure, (1, 2, 4, 8), "test") == {1: 9.0, 2: 9.0, 4: 12.0, 8: 12.0}


def test_a_cached_profile_is_checked_at_its_smallest_size_and_those_rounds_use():
    assert check_sizes({1: 1.0, 2: 1.0, 8: 2.0, 16: 3.0, 32: 5.0}) == (1, 8, 16)
    assert check_sizes({1: 1.0, 2: 1.0, 8: 2.0, 12: 3.0}) == (1, 8)
    assert check_sizes({1: 1.0, 2: 1.0, 4: 2.0}) == (1, 4)
    assert check_sizes({1: 1.0}) == (1,)
