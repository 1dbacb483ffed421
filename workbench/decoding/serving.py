"""The batched engine behind one thread, for an app that serves many users at once.

    server = BatchServer(pair, num_speculative_tokens=8, max_batch_size=4)
    ticket = server.submit(prompt, max_new_tokens=64, k=3, temperature=0.0)   # from any thread
    for ev in ticket.events(): ...        # this request's StepEvents, as its steps complete
    ticket.result()                       # its GenerationResult (error set if it failed alone)

One thread owns the `BatchDecoder` and steps it while any request is queued or decoding; each
step's events go to their own request's queue, so a user only ever reads their own tokens. Requests
join the batch between steps and leave as they finish; each keeps its own k, sampling settings and
seed (the rows of a step share one verifier forward, padded to the longest k + 1). A request whose
settings are bad is refused in `submit`, before it reaches the batch; one that fails while decoding
ends alone; an unexpected error in a step ends every request then in the batch with its message,
and the server keeps serving.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from workbench.decoding.batch import BatchDecoder
from workbench.decoding.events import GenerationResult, StepEvent

_DONE = object()


class Ticket:
    """One request in the server: its events as they come, then its result."""

    def __init__(self, server: "BatchServer", rid: int, rule: str) -> None:
        self.server, self.rid = server, rid
        self.rule = rule  # the acceptance rule that judges its proposals, as SpecDecoder names it
        self._queue: queue.Queue = queue.Queue()
        self._result: GenerationResult | None = None

    def events(self, timeout: float | None = None) -> Iterator[StepEvent]:
        """This request's events until it ends (queue.Empty after `timeout` seconds without one).
        Closing the iterator early (a user pressed Stop) cancels the request."""
        finished = False
        try:
            while True:
                item = self._queue.get(timeout=timeout)
                if item is _DONE:
                    finished = True
                    return
                yield item
        finally:
            if not finished:
                self.cancel()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The finished request's result (waits for it, draining the events)."""
        for _ in self.events(timeout):
            pass
        return self._result

    def cancel(self) -> None:
        self.server.cancel(self)


class BatchServer:
    """A `BatchDecoder` stepped by a thread of its own (module docstring)."""

    def __init__(self, pair, num_speculative_tokens: int = 8, max_batch_size: int = 4, max_len: int | None = None,
                 **decoder) -> None:
        self.engine = BatchDecoder(pair, num_speculative_tokens, max_batch_size, max_len, **decoder)
        self._lock = threading.Condition()
        self._tickets: dict[int, Ticket] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="workbench-batch-engine", daemon=True)
        self._thread.start()

    @property
    def batch_sizes(self) -> list[int]:
        """The rows of every step so far (how often users really shared a forward)."""
        with self._lock:
            return [s.batch_size for s in self.engine.history]

    @property
    def live(self) -> int:
        """Requests queued or decoding now."""
        with self._lock:
            return len(self.engine.rows) + len(self.engine.queue)

    def submit(self, prompt, **settings) -> Ticket:
        """Queue a request (settings as `BatchDecoder.submit`); bad settings raise here."""
        with self._lock:
            if self._closed:
                raise RuntimeError("BatchServer: closed; expected an open server")
            rid = self.engine.submit(prompt, **settings)
            ticket = self._tickets[rid] = Ticket(self, rid, self.engine.acceptance_rule(self.engine.queue[-1]))
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        with self._lock:
            if self.engine.cancel(ticket.rid):
                self._deliver([], [ticket.rid])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.engine.idle and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                try:
                    events = self.engine.step()
                except Exception as e:  # a bug, not a request's fault: end what is in flight, keep serving
                    events = []
                    for rid in [r.rid for r in (*self.engine.rows, *self.engine.queue)]:
                        self.engine.cancel(rid)
                        self.engine.finished[rid].error = f"the batch step failed: {type(e).__name__}: {e}"
                        self.engine.finished[rid].finish = "error"
                self._deliver(events, [rid for rid in self._tickets if rid in self.engine.finished])

    def _deliver(self, events: list, done: list[int]) -> None:
        """Route a step's events to their tickets, then close the finished ones (the lock is held)."""
        for rid, ev in events:
            self._tickets[rid]._queue.put(ev)
        for rid in done:
            ticket = self._tickets.pop(rid, None)
            if ticket is not None:
                ticket._result = self.engine.result(rid)
                del self.engine.finished[rid]
                ticket._queue.put(_DONE)
