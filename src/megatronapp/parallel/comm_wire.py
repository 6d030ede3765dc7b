"""The modelled wire: an op whose bytes a comm interceptor says are still on the wire may not complete yet.

An interceptor (`parallel/link_model.py`, a slow-wire fault drill) returns the seconds an op's bytes take; `comm`
turns them into a monotonic due time. A collective's caller is held until then (`hold`), an asynchronous op's
handle reports completion only then, and a late send leaves through its stream's `Wire`: messages of one
(group, peer) stream leave in order, each no earlier than its due time, while the sender goes on.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable


def hold(due: float) -> None:
    """Block until `due` (a modelled wire still carrying the op's bytes); at once when `due` is 0 or past."""
    if due:
        left = due - time.monotonic()
        if left > 0:
            time.sleep(left)


class Wire:
    """Late delivery on one (group, peer) stream: a daemon thread issues each message at its due time, in order,
    waits for it, then calls its `done` (with the error, if any)."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[tuple[float, Callable[[], list], Callable[..., None]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="comm-wire", daemon=True).start()

    def put(self, due: float, issue: Callable[[], list], done: Callable[..., None]) -> None:
        self.q.put((due, issue, done))

    def close(self) -> None:
        """Let the thread end once the messages already put have left."""
        self.q.put(None)

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            due, issue, done = item
            hold(due)
            try:
                for work in issue():
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                done(e)
                continue
            done()
