"""Worker processes that run user code one item at a time, each item on its own clock.

    pool = WorkerPool(setup, (arg,), num_workers=2, timeout_s=10.0, name="reward")
    outcomes = pool.run(items)   # aligned with items: .value, .error, .timed_out, .seconds
    pool.close()

``setup(*setup_args)`` runs once in every fresh worker (import the user's
function, lower the memory limit, build tools) and returns the handler that is
called on each item; the handler's return value comes back as ``value``. An
item whose handler raises (anything, ``SystemExit`` and ``MemoryError``
included) or whose value does not pickle comes back with ``error`` set; an item
that runs past ``timeout_s`` (counted from when its worker receives it) or
whose worker dies (segfault, ``os._exit``, the kernel's OOM killer) comes back
with ``error`` set too, and its worker is killed and replaced, so one bad item
costs only itself. A worker that dies or hangs while starting means the setup
itself is broken: ``run`` raises, since every replacement would repeat it.

Workers are our own processes with one pipe each rather than a
concurrent.futures pool, because a futures pool can neither time an item from
the moment it starts nor kill one stuck worker without breaking the whole pool.
Used by ``spmdrl.reward.rule`` (scoring) and ``spmdrl.agent.runner`` (tool calls).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

# A handler's error message is cut to this many characters: it travels over the pipe and into logs and
# prompts.
_MAX_ERROR_CHARS = 500


@dataclass
class Outcome:
    """What became of one item: ``value`` when ``error`` is empty."""

    value: Any = None
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0  # from when the worker received the item until its answer, death or timeout


def _worker_main(conn: multiprocessing.connection.Connection, setup: Callable[..., Callable[[Any], Any]],
                 setup_args: tuple) -> None:
    """Worker process: set up, announce readiness, then handle items until told to stop."""
    handler = setup(*setup_args)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, item = msg
        try:
            conn.send(("ok", idx, handler(item)))
        except BaseException as err:
            # all the item's own: a SystemExit or MemoryError must not end the worker
            try:
                conn.send(("error", idx, f"{type(err).__name__}: {str(err)[:_MAX_ERROR_CHARS]}"))
            except Exception:  # the pipe is gone: the parent sees a dead worker
                return


class _Worker:
    def __init__(self, ctx: Any, setup: Callable[..., Any], setup_args: tuple, name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, setup, setup_args), daemon=True,
                                name=f"spmdrl-{name}")
        self.proc.start()
        child.close()
        self.ready = False
        self.born = time.monotonic()
        self.item: Optional[int] = None  # index of the item being handled
        self.started = 0.0  # when that item was sent

    def send(self, idx: int, item: Any) -> None:
        self.conn.send((idx, item))
        self.item, self.started = idx, time.monotonic()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=2)
        self.kill()


class WorkerPool:
    """Up to ``num_workers`` processes, each fed one item at a time and replaced when it hangs or dies.

    ``name`` ("reward", "tool") names the processes and the messages; ``timeout_note`` (a config key)
    is added to timeout messages and ``context`` to start-up errors. Workers start on the first
    ``run`` that needs them and are kept for later ones.
    """

    def __init__(self, setup: Callable[..., Callable[[Any], Any]], setup_args: tuple, *, num_workers: int,
                 timeout_s: float, name: str, start_timeout_s: float, timeout_note: str = "",
                 context: str = "") -> None:
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.setup, self.setup_args, self.name = setup, setup_args, name
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, timeout_s, start_timeout_s
        self.timeout_note = f" ({timeout_note})" if timeout_note else ""
        self.context = context
        self.workers: list[_Worker] = []

    def _spawn(self) -> _Worker:
        return _Worker(self.ctx, self.setup, self.setup_args, self.name)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._spawn()

    def _start_failed(self, what: str, detail: str = "") -> RuntimeError:
        self.close()
        notes = ", ".join(n for n in (detail, self.context) if n)
        return RuntimeError(f"a {self.name} worker {what}" + (f" ({notes})" if notes else ""))

    def run(self, items: Sequence[Any]) -> list[Outcome]:
        """Outcomes aligned with ``items``; a failing item is an outcome with ``error`` set, never an
        exception."""
        outcomes = [Outcome() for _ in items]
        while len(self.workers) < min(self.num_workers, len(items)):
            self.workers.append(self._spawn())
        pending = deque(range(len(items)))
        while pending or any(w.item is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.item is None and pending:
                    idx = pending.popleft()
                    try:
                        w.send(idx, items[idx])
                    except OSError:  # died while idle: retry the item on its replacement
                        pending.appendleft(idx)
                        self._replace(w)
                    except Exception as err:  # the item does not pickle
                        outcomes[idx].error = f"{type(err).__name__}: {err}"
            now = time.monotonic()
            deadlines = [w.started + self.timeout_s for w in self.workers if w.item is not None]
            deadlines += [w.born + self.start_timeout_s for w in self.workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            ready = multiprocessing.connection.wait([w.conn for w in self.workers], timeout=wait_s)
            for w in [w for w in self.workers if w.conn in ready]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the process died (crash, os._exit, memory limit, OOM kill)
                    w.proc.join(timeout=1)  # reap it, so the exit code is known for the message
                    if not w.ready:
                        raise self._start_failed("exited during start-up",
                                                 f"exit code {w.proc.exitcode}") from None
                    if w.item is not None:
                        out = outcomes[w.item]
                        out.error = f"{self.name} worker died (exit code {w.proc.exitcode})"
                        out.seconds = time.monotonic() - w.started
                    self._replace(w)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    continue
                out = outcomes[msg[1]]
                out.seconds = time.monotonic() - w.started
                if msg[0] == "ok":
                    out.value = msg[2]
                else:
                    out.error = msg[2]
                w.item = None
            now = time.monotonic()
            for w in list(self.workers):
                if w.item is not None and now - w.started >= self.timeout_s:
                    out = outcomes[w.item]
                    out.timed_out, out.seconds = True, now - w.started
                    out.error = f"timed out after {self.timeout_s:g} s{self.timeout_note}"
                    self._replace(w)
                elif not w.ready and now - w.born >= self.start_timeout_s:
                    raise self._start_failed(f"did not start within {self.start_timeout_s:g} s")
        return outcomes

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
