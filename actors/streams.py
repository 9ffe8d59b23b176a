"""Streamed requests by key: their updates as rounds accept tokens, and their cancellation.

A stream runs its request on a thread of its own and hands its tokens (cut as `generate` cuts them) to the
caller as they come, then the request's stats. `cancel(key)` ends it after the round in flight, or before
any target work when it has not been admitted yet, even when it comes before the stream has started.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

from treegraft_dist.decoding.request import Generation, truncate

EARLY_CANCELS = 4096  # keys cancelled before their stream started that are remembered, the newest kept

# run(on_tokens, cancelled) -> the request's Generation
Runner = Callable[[Callable[[list[int]], bool], threading.Event], Generation]


class StreamRegistry:
    def __init__(self):
        self.lock = threading.Lock()  # the registry only: never held across a remote call
        self._cancels: dict[str, threading.Event] = {}
        self._cancelled_early: dict[str, None] = {}  # ordered: the oldest are dropped first

    def stream(self, key: str, max_new: int, eos: set[int], run: Runner) -> Iterator[dict]:
        """{"tokens": [new ids]} as `run`'s rounds accept them (cut at `max_new` and `eos`), then {"stats":
        RequestStats}; `run`'s exception is raised to the caller. The request is cancelled when the caller
        drops the stream."""
        updates: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            cancelled = self._cancels[key] = threading.Event()
            if key in self._cancelled_early:  # cancelled while it waited for a thread
                self._cancelled_early.pop(key)
                cancelled.set()
        sent = 0

        def on_tokens(out: list[int]) -> bool:
            nonlocal sent
            cut = truncate(out, max_new, eos)
            if len(cut) > sent and not cancelled.is_set():
                updates.put(cut[sent:])
                sent = len(cut)
            return cancelled.is_set()

        def request() -> None:
            try:
                updates.put(run(on_tokens, cancelled))
            except BaseException as e:  # handed to the generator, which raises it to the caller
                updates.put(e)

        threading.Thread(target=request, name=f"request-{key}", daemon=True).start()
        try:
            while True:
                item = updates.get()
                if isinstance(item, list):
                    yield {"tokens": item}
                elif isinstance(item, Generation):
                    yield {"stats": item.stats}
                    return
                else:
                    raise item
        finally:
            cancelled.set()
            self._cancels.pop(key, None)

    def cancel(self, key: str) -> bool:
        """Set the cancel event of the stream `key`; False when it is not running (then a stream of that key
        that starts later is cancelled at once)."""
        with self.lock:
            event = self._cancels.get(key)
            if event is None:
                self._cancelled_early[key] = None
                while len(self._cancelled_early) > EARLY_CANCELS:  # keys of requests that ended meanwhile
                    self._cancelled_early.pop(next(iter(self._cancelled_early)))
                return False
        event.set()
        return True
