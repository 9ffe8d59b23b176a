"""Faults stay with the request that caused them, and every wait is bounded.

Without Ray: the request checks, and the batcher's bounded answers and supervised loop (a stand-in group).
On the module's Ray cluster, tiny models on CPU (n-gram drafting only): bad input is refused before any
target work; one request's failing work (prepared or deep in the shared pass) fails it alone while the
requests beside it still give the target's greedy output, with no rebuild; only a killed worker rebuilds
the group, which health() shows; admission waits at most queue_timeout_s, and a request cancelled while
queued never reaches the target; the batcher's loop restarts after a failure; health() answers while
requests run and hold the coordinator's locks, and says "dead" for a coordinator that is gone.
"""

import random
import threading
import time

import pytest
import ray
from tiny import VOCAB, char_tokenizer, hf_greedy, save_tiny, tiny_model

from actors.engine import DistributedEngine
from actors.resources import PlacementError, Resources
from actors.target import TargetBatcher, TargetGroupError
from treegraft_dist.decoding.batch import STEP, ItemFailed, Work
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.engine import check_request
from treegraft_dist.decoding.errors import EngineUnavailable, QueueTimeout, RequestFailed
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.models.hf import CausalLM

CPU = dict(device="cpu", target_cpus=0.1, middle_cpus=0.1, ngram_cpus=0.1, coordinator_cpus=0.1, torch_threads=1,
           placement_timeout_s=30, dist_timeout_s=60, adapt_budget=False)
MARKER = VOCAB - 1  # a prompt that starts with it is the culprit of test_a_pass_that_raises_...


# -- without Ray ------------------------------------------------------------------------------------------------
def test_check_request_refuses_what_the_target_cannot_run():
    check_request([0, 5, VOCAB - 1], 0, seed=-(2**63), vocab_size=VOCAB, sampling=SamplingParams(1e-40))
    check_request([3], 10, seed=2**64 - 1)
    for args, kwargs, match in [
        (([], 5), {}, "empty"),
        (([1, VOCAB], 5), dict(vocab_size=VOCAB), f"token id {VOCAB}"),
        (([1, -1], 5), {}, "token id -1"),
        (([1, 2.5], 5), {}, "integer token ids"),
        (([[1, 2]], 5), {}, "integer token ids"),
        (([1], -1), {}, "max_new_tokens"),
        (([1], 2.0), {}, "max_new_tokens"),
        (([1], True), {}, "max_new_tokens"),
        (([1], 5), dict(seed=2**64), "seed"),
        (([1], 5), dict(seed=-(2**63) - 1), "seed"),
        (([1], 5), dict(seed=1.5), "seed"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_request(*args, **kwargs)
    unchecked = object.__new__(SamplingParams)  # as params arrive unpickled: __init__ never ran
    for name, value in (("temperature", float("nan")), ("top_k", 0), ("top_p", 1.0)):
        object.__setattr__(unchecked, name, value)
    with pytest.raises(ValueError, match="temperature"):
        check_request([1], 5, sampling=unchecked)


class StandInGroup:
    """TargetGroup's `call` for TargetBatcher, without Ray: answers each step with its token + 1, an item
    marked FAIL with ItemFailed, and waits on `gate` first."""

    FAIL = -7

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls = []

    def call(self, generation, method, items):
        self.calls.append([w.rid for w in items])
        self.gate.wait(30)
        return [ItemFailed("input", "bad token") if w.token == self.FAIL else w.token + 1 for w in items]


def test_the_batcher_answers_in_bounded_time_and_fails_items_alone():
    group = StandInGroup()
    batcher = TargetBatcher(group, 64, 8, answer_timeout_s=0.5)
    try:
        assert batcher.step(0, 1, 41) == 42
        with pytest.raises(ValueError, match="bad token"):
            batcher.step(0, 2, StandInGroup.FAIL)
        group.gate.clear()  # the pass in flight hangs: its request gives up at the bound
        t = time.monotonic()
        with pytest.raises(EngineUnavailable, match="no answer within 0.5 s"):
            batcher.step(0, 3, 1)
        assert 0.4 < time.monotonic() - t < 5
        # A request that gave up while still queued is taken out of the queue: no pass runs it later.
        with pytest.raises(EngineUnavailable):
            batcher.step(0, 4, 1)
        group.gate.set()
        assert batcher.step(0, 5, 9) == 10
        assert [4] not in group.calls and group.calls[-1] == [5]
    finally:
        group.gate.set()
        batcher.close()


def test_a_prompt_that_shares_a_pass_is_prefilled_without_its_scores():
    """A prompt alone keeps its n-gram scores (want_prefill_cache); prompts whose chunks share a pass lose them, for
    every later chunk too: the target is shared, and no request in the pass waits for another's scores."""
    group = StandInGroup()
    passes = []
    answer = group.call

    def call(generation, method, items):
        passes.append([(w.rid, w.want_prefill_cache) for w in items])
        return answer(generation, method, items)

    group.call = call
    batcher = TargetBatcher(group, 64, 8, answer_timeout_s=10)
    try:
        batcher.prefill(0, 1, list(range(12)), 0, True, None)  # alone: two chunks of 8 and 4, both scored
        assert passes == [[(1, True)], [(1, True)]]
        group.gate.clear()  # a pass in flight holds the target while two prompts arrive
        held = threading.Thread(target=batcher.step, args=(0, 9, 5))
        held.start()
        while not group.calls or group.calls[-1] != [9]:
            time.sleep(0.01)
        prompts = [threading.Thread(target=batcher.prefill, args=(0, rid, list(range(12)), 0, True, None))
                   for rid in (2, 3)]
        for t in prompts:
            t.start()
        time.sleep(0.2)
        group.gate.set()
        for t in [held, *prompts]:
            t.join(10)
        later = [p for p in passes[3:] if any(rid in (2, 3) for rid, _ in p)]
        assert sorted(rid for rid, _ in later[0]) == [2, 3]  # they shared their first pass
        assert [want for p in later for rid, want in p] == [False] * 4  # and no chunk of either was scored
        batcher.leave(2)
        batcher.leave(3)
        assert batcher._unscored == set()
    finally:
        group.gate.set()
        batcher.close()


def test_the_batcher_loop_restarts_after_a_failure_and_fails_what_waited():
    group = StandInGroup()
    batcher = TargetBatcher(group, 64, 8, answer_timeout_s=10)
    try:
        original, failures = batcher._take, []

        def broken():
            batcher._take = original
            failures.append(1)
            raise KeyError("injected")

        batcher._take = broken
        with pytest.raises(EngineUnavailable, match="batcher failed.*KeyError.*restarted"):
            batcher.step(0, 1, 1)
        assert failures == [1] and batcher.restarts == 1
        assert batcher.step(0, 2, 5) == 6  # the restarted loop serves the next request
        assert batcher.restarts == 1
    finally:
        batcher.close()
    with pytest.raises(TargetGroupError, match="shutting down"):
        batcher.submit(0, Work(STEP, 3, token=1))


def test_a_group_that_cannot_be_rebuilt_is_failed_and_retried_by_a_later_request(monkeypatch):
    import actors.target as target

    attempts = []

    def no_room(*args):
        attempts.append(1)
        raise PlacementError("no GPUs left")

    monkeypatch.setattr(target, "reserve", no_room)
    group = target.TargetGroup("unused", Resources(tp=1, **CPU), SamplingParams(), "float32")
    group.state = target.READY  # as a built group that then lost a rank
    group._ready.set()
    group._rebuild(0)
    assert (group.state, group.rebuilds, group.generation, len(attempts)) == ("failed", 1, 1, 1)
    group._rebuild(0)  # a second failing call of the lost generation does not rebuild again
    assert (group.rebuilds, len(attempts)) == (1, 1)
    with pytest.raises(TargetGroupError, match="could not be rebuilt.*no GPUs left.*another attempt"):
        group.wait_ready(timeout_s=0.1)
    wait_for(lambda: len(attempts) == 2 and group.state == "failed", timeout=10, what="a second attempt")
    assert group.rebuilds == 1 and not group._ready.is_set()


def test_ranks_answers_are_reconciled_item_by_item():
    """An item that failed on any rank fails (its request ends); any other difference between ranks means
    their shards are out of step."""
    from actors.target import _OutOfStep, _reconcile
    from treegraft_dist.decoding.verify import Verdict

    failed = ItemFailed("error", "out of memory")
    rank0 = [(5, "prefill cache"), Verdict([1], [7, 8]), 4, None]
    rank1 = [(5, None), Verdict([1], [7, 8]), failed, None]
    assert _reconcile([rank0, rank1]) == [(5, "prefill cache"), Verdict([1], [7, 8]), failed, None]
    for differs in ([(6, None)] + rank1[1:], [rank1[0], Verdict([], [9])] + rank1[2:], rank1[:3], 3):
        with pytest.raises(_OutOfStep):
            _reconcile([rank0, differs])
    assert _reconcile([(1, 2), (1, 2)]) == (1, 2)


# -- on Ray ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(ray_cluster, tmp_path_factory):
    """(the tiny target in memory, its saved folder)."""
    model = tiny_model("llama")
    return CausalLM(model), save_tiny(tmp_path_factory.mktemp("models") / "target", model, char_tokenizer())


def prompts(seed: int, n: int, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(length)] for _ in range(n)]  # MARKER never starts one


def generation(engine) -> int:
    return ray.get(engine.coordinator.__ray_call__.remote(lambda c: c.target.generation))


def wait_for(predicate, timeout=60.0, what="the condition"):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} did not hold within {timeout} s")


@pytest.fixture(scope="class")
def engine(models):
    """Target tp=2 over gloo, n-gram drafting only."""
    eng = DistributedEngine(models[1], None, resources=Resources(tp=2, **CPU), dtype="float32")
    yield eng
    eng.shutdown()


class TestFaultsStayWithTheirRequest:
    def test_bad_input_is_refused_before_any_target_work(self, engine, models):
        target = models[0]
        p = prompts(1, 1)[0]
        passes = engine.target_passes()
        for kwargs, match in [(dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
                              (dict(prompt_ids=p[:3] + [VOCAB] + p[3:]), f"token id {VOCAB}"),
                              (dict(max_new_tokens=-1), "max_new_tokens"),
                              (dict(max_new_tokens=2.5), "max_new_tokens")]:
            args = dict(prompt_ids=p, max_new_tokens=8, method="all-small") | kwargs
            with pytest.raises(ValueError, match=match):
                engine.generate(**args)
            stream = engine.stream(f"bad-{match}", **args)
            with pytest.raises(ValueError, match=match):
                ray.get(next(stream))
        assert engine.target_passes() == passes  # nothing reached the target
        # A temperature too small to divide by decodes greedily; a signed 64-bit seed seeds as its unsigned twin.
        greedy = hf_greedy(target, p, 16)
        for method in ("ar", "all-small"):
            assert engine.generate(p, 16, method, seed=3, sampling=SamplingParams(1e-40)).tokens == greedy
        hot = SamplingParams(temperature=1.0)
        assert (engine.generate(p, 16, "all-small", seed=-1, sampling=hot).tokens
                == engine.generate(p, 16, "all-small", seed=2**64 - 1, sampling=hot).tokens)
        assert engine.health()["rebuilds"] == 0 and generation(engine) == 0

    def test_work_with_a_bad_prompt_fails_its_request_alone(self, engine, models):
        """Work that bypasses the coordinator's checks, handed straight to the batcher beside running
        requests: the worker refuses it alone."""
        target = models[0]
        ps = prompts(2, 3)
        workers = {w._actor_id for w in engine.actors()["target"]}
        refs = [engine.submit(p, 40, m) for p, m in zip(ps, ("ar", "all-small", "ar"))]
        wait_for(lambda: any(n >= 4 for n in engine.progress().values()), what="a request under way")

        def inject(c, bad=VOCAB + 5):
            try:
                c.batcher.prefill(c.target.wait_ready(), 10**6, [1, bad, 2], 0, True, None)
            except Exception as e:
                return type(e).__name__, str(e)

        kind, message = ray.get(engine.coordinator.__ray_call__.remote(inject))
        assert kind == "ValueError" and "vocabulary" in message
        for p, ref in zip(ps, refs):
            assert engine.result(ref).tokens == hf_greedy(target, p, 40)
        assert engine.health()["rebuilds"] == 0 and generation(engine) == 0
        assert {w._actor_id for w in engine.actors()["target"]} == workers

    def test_a_pass_that_raises_fails_only_its_culprit(self, engine, models):
        """On every rank, a pass holding a prompt that starts with MARKER raises in its second layer, after the
        first wrote every request's cache shard: the culprit fails (RequestFailed), the requests that shared
        the pass still give the target's greedy output, and nothing is rebuilt."""
        target = models[0]

        def poison(worker, marker=MARKER):
            lm, log = worker.lm, []
            original, armed = lm.hidden_blocks, []

            def hidden_blocks(caches, ids, positions, attends):
                armed[:] = [len(caches)] if any(int(p[0]) == 0 and int(i[0]) == marker
                                                for i, p in zip(ids, positions)) else []
                try:
                    return original(caches, ids, positions, attends)
                finally:
                    armed.clear()

            def hook(module, args):
                if armed:
                    log.append(armed[0])
                    raise RuntimeError("injected fault in the second layer")

            lm.hidden_blocks = hidden_blocks
            worker.poison = (lm.model.model.layers[1].register_forward_pre_hook(hook), log)

        def cure(worker):
            del worker.lm.hidden_blocks
            handle, log = worker.poison
            handle.remove()
            return log

        ranks = engine.actors()["target"]
        ray.get([w.__ray_call__.remote(poison) for w in ranks])
        try:
            ps = prompts(3, 3)
            refs = [engine.submit(p, 120, m) for p, m in zip(ps, ("ar", "all-small", "ar"))]
            shared = False
            for attempt in range(5):  # until the culprit's prompt shared a pass with the others' rounds
                wait_for(lambda: any(n >= 2 for n in engine.progress().values()), what="a request under way")
                with pytest.raises(RequestFailed, match="injected fault"):
                    engine.generate([MARKER, 1, 2, 3, 4, 5], 8, "ar")
                logs = ray.get([w.__ray_call__.remote(lambda w: list(w.poison[1])) for w in ranks])
                assert logs[0] == logs[1]  # the ranks stayed in step
                shared = max(logs[0]) > 1
                if shared or all(ray.wait([r], timeout=0)[0] for r in refs):
                    break
            assert shared, logs
            for p, ref in zip(ps, refs):
                assert engine.result(ref).tokens == hf_greedy(target, p, 120)
        finally:
            ray.get([w.__ray_call__.remote(cure) for w in ranks])
        assert engine.health()["rebuilds"] == 0 and generation(engine) == 0
        p = prompts(4, 1)[0]
        assert engine.generate(p, 10, "all-small").tokens == hf_greedy(target, p, 10)

    def test_an_exception_in_live_workers_fails_their_pass_not_the_group(self, engine, models):
        """Every rank raises in one pass (their processes alive): the requests of that pass fail with
        RequestFailed; the group is not rebuilt and serves the next request."""
        def raise_once(worker):
            run = worker.batch.run

            def broken(items):
                worker.batch.run = run
                raise RuntimeError("injected worker fault")

            worker.batch.run = broken

        workers = engine.actors()["target"]
        ray.get([w.__ray_call__.remote(raise_once) for w in workers])
        p = prompts(14, 1)[0]
        with pytest.raises(RequestFailed, match="injected worker fault"):
            engine.generate(p, 10, "ar")
        assert engine.health()["rebuilds"] == 0 and generation(engine) == 0
        assert {w._actor_id for w in engine.actors()["target"]} == {w._actor_id for w in workers}
        assert engine.generate(p, 10, "all-small").tokens == hf_greedy(models[0], p, 10)

    def test_the_batcher_loop_restarts_after_an_injected_failure(self, engine, models):
        def inject(c):
            b = c.batcher
            original = b._take

            def broken():
                b._take = original
                raise RuntimeError("injected batcher fault")

            b._take = broken

        before = engine.health()["batcher_restarts"]
        ray.get(engine.coordinator.__ray_call__.remote(inject))
        p = prompts(5, 1)[0]
        with pytest.raises(EngineUnavailable, match="injected batcher fault"):
            engine.generate(p, 10, "ar")
        assert engine.health()["batcher_restarts"] == before + 1
        assert engine.generate(p, 10, "all-small").tokens == hf_greedy(models[0], p, 10)
        assert engine.health()["rebuilds"] == 0

    def test_health_answers_while_requests_run_and_hold_locks(self, engine):
        refs = [engine.submit(p, 400, "ar") for p in prompts(6, 3)]
        wait_for(lambda: engine.health()["running"] >= 1, what="a request running")

        def hold(c, seconds=10.0):  # as a request (or a slow path) holding the coordinator's locks
            with c.streams.lock, c.life.lock, c.load.lock, c.admission.cond:
                time.sleep(seconds)

        held = engine.coordinator.__ray_call__.remote(hold)
        locked = engine.coordinator.__ray_call__.remote
        wait_for(lambda: ray.get(locked(lambda c: c.load.lock.locked())), what="the locks held")
        for _ in range(3):
            t = time.monotonic()
            h = engine.health(timeout_s=5.0)
            assert time.monotonic() - t < 2.5, h
            assert h["state"] == "ready" and h["running"] >= 1
            assert set(h) == {"state", "rebuilds", "running", "waiting", "kv_used_tokens", "kv_capacity_tokens",
                              "batcher_restarts"}
            assert 0 < h["kv_used_tokens"] <= h["kv_capacity_tokens"]
        assert not ray.wait([held], timeout=0)[0]  # the locks were held the whole time
        ray.get(held)
        for ref in refs:
            engine.result(ref)

    def test_only_a_killed_worker_rebuilds_the_group(self, engine, models):
        """Last of the class: the group is rebuilt. health() shows it; new requests are turned away at once
        while it is, and served by the new group after."""
        target = models[0]
        assert engine.health()["rebuilds"] == 0
        doomed = engine.submit(prompts(7, 1)[0], 400, "ar")
        wait_for(lambda: any(n >= 4 for n in engine.progress().values()), what="a request under way")
        old = engine.actors()["target"]
        ray.kill(old[1])
        with pytest.raises(TargetGroupError, match="target worker died.*rebuilt"):
            engine.result(doomed)
        states, turned_away = [], None
        t = time.monotonic()
        while time.monotonic() - t < 120 and not (states and states[-1] == "ready" and "rebuilding" in states):
            states.append(engine.health()["state"])
            if states[-1] == "rebuilding" and turned_away is None:
                t0 = time.monotonic()
                with pytest.raises(TargetGroupError, match="rebuilding"):
                    engine.generate(prompts(8, 1)[0], 5, "ar")
                turned_away = time.monotonic() - t0
            time.sleep(0.02)
        assert "rebuilding" in states and states[-1] == "ready", states
        assert turned_away < 5.0  # at once, not after the rebuild (which takes longer)
        h = engine.health()
        assert h["rebuilds"] == 1 and generation(engine) == 1
        new = engine.actors()["target"]
        assert len(new) == 2 and not {w._actor_id for w in new} & {w._actor_id for w in old}
        ps = prompts(9, 2)
        for p, g in zip(ps, engine.generate_many(ps, 20, "all-small")):
            assert g.tokens == hf_greedy(target, p, 20)
        assert engine.health()["rebuilds"] == 1


# -- admission ---------------------------------------------------------------------------------------------------
TREE = TreeConfig()
LONG, SHORT = 420, 8  # new tokens of the request that holds the engine's KV cache, and of the others
PROMPT = 12


def kv_tokens(max_new: int) -> int:
    """What admission reserves for a request (Admission.admit): twice its cache."""
    return 2 * (PROMPT + max_new + TREE.max_tree_depth + 1)


@pytest.fixture(scope="class")
def small(models):
    """Target tp=1 with room for one long request's KV cache, a 3 s queue bound, and every pass slowed to
    20 ms and logged (the request ids it held) on the worker."""
    cfg = models[0].model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    capacity = kv_tokens(LONG) + kv_tokens(SHORT) // 2  # the long request fits; nothing else beside it
    res = Resources(tp=1, kv_cache_gb=(capacity + 0.5) * per_token / 1e9, queue_timeout_s=3.0, **CPU)
    eng = DistributedEngine(models[1], None, resources=res, dtype="float32")

    def slow_and_log(worker):
        run, worker.seen = worker.batch.run, set()

        def logged(items):
            worker.seen.update(w.rid for w in items)
            time.sleep(0.02)
            return run(items)

        worker.batch.run = logged

    eng.seen = lambda: ray.get(eng.actors()["target"][0].__ray_call__.remote(lambda w: set(w.seen)))
    ray.get(eng.actors()["target"][0].__ray_call__.remote(slow_and_log))
    assert eng.health()["kv_capacity_tokens"] == capacity
    yield eng
    eng.shutdown()


def hold_the_cache(engine, key):
    """A long streamed request that holds the whole KV budget until cancelled."""
    stream = engine.stream(key, prompts(10, 1, PROMPT)[0], LONG, "ar")
    wait_for(lambda: engine.health()["running"] == 1, what="the long request admitted")
    return stream


def drain(stream) -> list:
    return [ray.get(ref) for ref in stream]


class TestAdmission:
    def test_admission_waits_at_most_queue_timeout_s(self, small):
        holder = hold_the_cache(small, "holder-1")
        try:
            t = time.monotonic()
            with pytest.raises(QueueTimeout, match="within 3 s") as e:
                small.generate(prompts(11, 1, PROMPT)[0], SHORT, "ar")
            assert 2.9 < time.monotonic() - t < 10 and e.value.retry_after > 0
            assert small.health()["waiting"] == 0
            with pytest.raises(ValueError, match="more than the engine holds"):  # could never fit: not queued
                small.generate(prompts(11, 1, PROMPT)[0], 10 * LONG, "ar")
        finally:
            ray.get(small.cancel("holder-1"))
            out = drain(holder)
        assert out[-1]["stats"].new_tokens < LONG  # it was still running: the wait was for its cache

    def test_a_request_cancelled_while_queued_never_reaches_the_target(self, small):
        seen = small.seen()
        holder = hold_the_cache(small, "holder-2")
        try:
            queued = small.stream("queued", prompts(12, 1, PROMPT)[0], SHORT, "ar")
            wait_for(lambda: small.health()["waiting"] == 1, what="the request queued")
            assert ray.get(small.cancel("queued"))
            out = drain(queued)
            assert len(out) == 1 and out[0]["stats"].new_tokens == 0 and out[0]["stats"].rounds == 0
            assert small.health()["waiting"] == 0
        finally:
            ray.get(small.cancel("holder-2"))
            drain(holder)
        assert len(small.seen() - seen) == 1  # the holder's request alone reached the target
        # Cancelled before its request even started: no target work at all.
        passes = small.target_passes()
        assert ray.get(small.cancel("early")) is False
        out = drain(small.stream("early", prompts(13, 1, PROMPT)[0], SHORT, "ar"))
        assert len(out) == 1 and out[0]["stats"].new_tokens == 0
        assert small.target_passes() == passes and len(small.seen() - seen) == 1

    def test_health_says_dead_for_a_coordinator_that_is_gone(self, small):
        assert small.health()["state"] == "ready"
        ray.kill(small.coordinator)
        t = time.monotonic()
        wait_for(lambda: small.health(timeout_s=1.0)["state"] == "dead", timeout=30, what="dead")
        assert time.monotonic() - t < 30
        h = small.health(timeout_s=0.5)
        assert h["state"] == "dead" and set(h) >= {"rebuilds", "running", "waiting", "batcher_restarts"}
