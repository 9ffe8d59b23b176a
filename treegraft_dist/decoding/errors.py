"""What can end a request early, as types the server maps to HTTP answers.

    ValueError         the request's own input cannot be served (400); raised before any model work
    EngineUnavailable  the engine cannot take the request now (503 with Retry-After): it is rebuilding
                       after a lost worker, not ready yet, or a wait for it ran past its bound
    QueueTimeout       the request waited longer than its admission bound for room to run (503)
    RequestFailed      something went wrong while computing this request alone (500, with the request id);
                       other requests and the engine are unaffected

Only a worker that is gone (actor death, a lost process, a collective that times out) makes the engine
rebuild; everything else stays with the request that caused it.
"""

from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine cannot serve the request now; `retry_after` seconds is a fair wait before trying again."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # keeps retry_after across Ray's pickling
        return type(self), (str(self), self.retry_after)


class QueueTimeout(EngineUnavailable):
    """The request waited past its admission bound for KV cache room or a free slot."""


class RequestFailed(RuntimeError):
    """One request's own computation failed (not its input, not a lost worker); only it is failed."""
