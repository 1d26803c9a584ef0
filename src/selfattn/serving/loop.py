"""The one loop that steps an :class:`~selfattn.serving.Engine`: :class:`EngineLoop`.

Every consumer of an engine goes through it: the offline :meth:`Engine.generate` runs its cycles
on the caller's thread (:meth:`EngineLoop.run_until`: thread-local settings such as
``sa.backends.use`` apply, and nothing crosses threads); :meth:`Engine.stream` and the HTTP
server submit from their event loops (:meth:`EngineLoop.submit`) and the loop's thread steps
while there is work. One cycle is one :meth:`Engine.step` (a step that raises fails the open
requests: :meth:`Engine.fail_open`), then the delivery of its outputs to each request's sink.

Delivery to event loops: a sink of :meth:`submit` posts ``(tag, output)`` to an
``asyncio.Queue``; a step's outputs reach each event loop in ONE ``call_soon_threadsafe`` per
loop and step (16 streams would otherwise wake it 16 times a step). An event loop that closed
has its requests aborted.

Admission: woken from idle, the thread lets a burst of arrivals land before its first step
(``admit_quiet_s``, ``admit_window_s``: :class:`~selfattn.serving.config.EngineConfig`), so
clients starting together share one prefill step. A server *holds* the loop (``start(hold=True)``):
its thread stays up while idle, and :meth:`Engine.generate` refuses to step the engine beside it;
otherwise the thread ends when the work does and the next submission starts another.
:meth:`stop` drains: it refuses new submissions, finishes every open request, ends the thread.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfattn.serving.engine import Engine

__all__ = ["EngineLoop", "ShuttingDown"]


class ShuttingDown(RuntimeError):
    """The loop is draining (:meth:`EngineLoop.stop`) and takes no new requests (a server
    answers 503)."""


class EngineLoop:
    """Steps ``engine`` (module docstring). ``admit_quiet_s`` / ``admit_window_s`` override the
    engine config's. :meth:`add`, :meth:`submit` and :meth:`abort` may be called from any
    thread."""

    def __init__(self, engine: Engine, *, admit_quiet_s: float | None = None,
                 admit_window_s: float | None = None):  # fmt: skip
        given = {"admit_quiet_s": admit_quiet_s, "admit_window_s": admit_window_s}
        config = engine.config.replace(**{k: v for k, v in given.items() if v is not None})
        self.engine = engine
        self.admit_quiet_s, self.admit_window_s = config.admit_quiet_s, config.admit_window_s
        self._arrivals = 0  # requests submitted so far (only compared for a change)
        self._wake = threading.Event()
        self._stopping = False
        self._held = False  # a server holds the thread up while idle
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()  # starting the thread, and its decision to end
        self._cycle_lock = threading.Lock()  # one cycle at a time (the outbox is per cycle)
        self._outbox: dict = {}  # event loop -> [(queue, item)], filled during a step

    @property
    def alive(self) -> bool:
        """Whether the loop's thread is running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def held(self) -> bool:
        """Whether a server holds the loop (started with ``hold=True`` and not stopped)."""
        return self._held

    def start(self, *, hold: bool = False) -> None:
        """Start the thread unless it runs; ``hold``: keep it up while idle, until :meth:`stop`."""
        with self._thread_lock:
            self._held = self._held or hold
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="selfattn-engine", daemon=True
                )
                self._thread.start()

    # -- submissions ------------------------------------------------------------------------------
    def add(self, prompt, params=None, request_id: str | None = None, *,
            sink: Callable | None = None) -> str:  # fmt: skip
        """:meth:`Engine.add_request` (same arguments and errors), refused while draining;
        ``sink(output)`` runs on the stepping thread. Nothing wakes the thread."""
        if self._stopping:
            raise ShuttingDown("the engine loop is shutting down; it takes no new requests")
        rid = self.engine.add_request(prompt, params, request_id, sink=sink)
        self._arrivals += 1
        return rid

    def submit(self, prompt, params, request_id: str | None, loop, queue, tag=None) -> str:
        """Add a request whose outputs arrive in ``queue`` (an ``asyncio.Queue`` of the event
        loop ``loop``, or anything with its ``put_nowait``, called on that loop) as ``(tag,
        output)``, and have the thread step it."""
        sink = functools.partial(self._post, loop, queue, tag)
        rid = self.add(prompt, params, request_id, sink=sink)
        self._wake.set()  # before start: a thread deciding to end sees it
        self.start()
        return rid

    def abort(self, request_id: str) -> None:
        """:meth:`Engine.abort`, and wake the thread to apply it."""
        self.engine.abort(request_id)
        self._wake.set()

    # -- cycles -----------------------------------------------------------------------------------
    def run_until(self, done: Callable[[], bool]) -> None:
        """Run cycles on the calling thread until ``done()`` (checked before each)."""
        while not done():
            self.cycle()

    def cycle(self) -> None:
        """One step of the engine, then its outputs' delivery."""
        with self._cycle_lock:
            try:
                self.engine.step()
            except Exception as e:  # one bad step: its requests end, the loop goes on
                self.engine.fail_open(e)
            self._flush()

    def _post(self, loop, queue, tag, out) -> None:  # a sink: on the stepping thread
        self._outbox.setdefault(loop, []).append((queue, (tag, out)))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody reads these any more
                for _, (_, out) in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._wake.wait()
            # Cleared before looking for work: a submission after this line sets it again.
            self._wake.clear()
            if engine.has_unfinished():  # idle until now
                self._gather_burst()
            while engine.has_unfinished():
                self.cycle()
            with self._thread_lock:
                if self._stopping or not (self._held or self._wake.is_set()):
                    self._thread = None
                    return

    def _gather_burst(self) -> None:
        """Before an idle engine's first step: wait while requests keep arriving, each within
        ``admit_quiet_s`` of the last, ``admit_window_s`` at most, and no longer once the waiting
        ones fill the running set or the loop stops."""
        deadline = time.monotonic() + self.admit_window_s
        seen = None
        while seen != self._arrivals and not self._stopping:
            seen = self._arrivals
            left = deadline - time.monotonic()
            if left <= 0 or self.engine.num_waiting() >= self.engine.scheduler.max_num_seqs:
                return
            time.sleep(min(self.admit_quiet_s, left))

    def stop(self, timeout: float | None = None) -> None:
        """Drain: refuse new requests, finish every open one, end the thread (waiting at most
        ``timeout`` seconds). Afterwards the loop takes requests again."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._stopping = self._held = False


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
