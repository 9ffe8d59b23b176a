"""Admission: a request runs once its KV cache fits beside those of the requests running.

A target pass holds a working copy of every cache in it, so a request reserves twice its length in tokens
(prompt + max_new_tokens + the deepest draft tree). A request that could never fit is refused at once
(ValueError); one that does not fit yet waits at most `queue_timeout_s` (QueueTimeout), or until it is
cancelled. The counters are plain ints a health check reads without taking the lock.
"""

from __future__ import annotations

import threading
import time

from treegraft_dist.decoding.errors import QueueTimeout

QUEUE_RETRY_AFTER_S = 5.0  # what a request turned away from a full queue is told to wait


class Admission:
    def __init__(self, queue_timeout_s: float | None):
        self.queue_timeout_s = queue_timeout_s
        self.cond = threading.Condition()  # guards the counters' updates; waited on for room
        self.capacity = 0  # KV cache tokens the target holds (set once it is built)
        self.used = 0  # tokens reserved by the requests admitted
        self.active = 0  # requests admitted and running
        self.queued = 0  # requests waiting for admission

    def admit(self, tokens: int, cancelled: threading.Event | None = None) -> int | None:
        """Wait until a request's KV cache of `tokens` fits beside those admitted. Returns the tokens reserved
        (twice `tokens`), or None when `cancelled` was set first. ValueError when it could never fit;
        QueueTimeout after queue_timeout_s."""
        need = 2 * tokens
        if need > self.capacity:
            raise ValueError(f"the request needs a KV cache of {tokens} tokens (prompt + max_new_tokens + the draft "
                             f"tree), more than the engine holds ({self.capacity // 2} tokens): shorten the "
                             "prompt or ask for fewer tokens")
        bound = self.queue_timeout_s
        deadline = None if bound is None else time.monotonic() + bound
        with self.cond:
            self.queued += 1
            try:
                while True:
                    if cancelled is not None and cancelled.is_set():
                        return None
                    if self.used + need <= self.capacity:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise QueueTimeout(f"no room for the request's KV cache ({tokens} tokens) within {bound:g} s: "
                                           f"{self.active} requests hold the engine's {self.capacity // 2} "
                                           "tokens; try again later", retry_after=QUEUE_RETRY_AFTER_S)
                    self.cond.wait(left)
            finally:
                self.queued -= 1
            self.used += need
            self.active += 1
        return need

    def leave(self, reserved: int) -> None:
        """A request admitted with `reserved` tokens (what `admit` returned) has ended: its room is free."""
        with self.cond:
            self.used -= reserved
            self.active -= 1
            self.cond.notify_all()

    def wake(self) -> None:
        """Have the waiting requests look again (one of them was cancelled: it leaves the queue)."""
        with self.cond:
            self.cond.notify_all()
