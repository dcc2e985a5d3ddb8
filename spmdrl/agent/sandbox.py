"""Tool calls run in worker processes, each call with a clock, an output cap and a memory limit.

    runner = ToolRunner(specs, num_workers=2, timeout_s=10, memory_mb=1024)
    results = runner.run([ToolCall("calculator", {"expression": "2*3"}, state={}), ...])
    results[0].text, results[0].state, results[0].error, results[0].timed_out

What a worker isolates: a tool that raises, returns something other than a
string, hangs, allocates past ``memory_mb`` (RLIMIT_AS) or crashes the
interpreter (segfault, ``os._exit``) costs its own call only: the call comes
back as an error message for the model, is counted, and a hung or dead worker
is killed and replaced. Output past ``MAX_OUTPUT_CHARS`` is cut in the worker,
so a flood never reaches the trainer. What it does not isolate: the worker is
an ordinary child process of the rank, with the rank's user, file system,
environment variables and network; a tool can read and write files and open
sockets. Run only tools you trust not to do that (the built-in calculator
parses arithmetic with ``ast`` and executes nothing).

Workers are our own processes with one pipe each (as ``spmdrl.rewards``): a
concurrent.futures pool can neither time a call from the moment it starts nor
kill one stuck worker without breaking the whole pool.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from spmdrl.agent.tools import ToolSpec

MAX_OUTPUT_CHARS = 16_384  # cut in the worker; max_tool_response_length then cuts in tokens
_START_TIMEOUT_S = 60.0  # a fresh worker imports only spmdrl.agent (no torch), so this is generous


@dataclass
class ToolCall:
    name: str
    parameters: dict
    state: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    text: str = ""
    state: dict = field(default_factory=dict)
    error: str = ""  # non-empty: the call failed; ``text`` is then the message shown to the model
    timed_out: bool = False
    seconds: float = 0.0


def _limit_memory(memory_mb: int) -> None:
    try:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # no RLIMIT_AS on this platform: the timeout still applies
        pass


def _worker_main(conn: multiprocessing.connection.Connection, specs: list[ToolSpec], memory_mb: int) -> None:
    _limit_memory(memory_mb)
    tools = {s.name: s.build() for s in specs}
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, call = msg
        try:
            text = tools[call.name].execute(call.parameters, call.state)
            if not isinstance(text, str):
                raise TypeError(f"tool returned {type(text).__name__}, not str")
            conn.send(("ok", idx, text[:MAX_OUTPUT_CHARS], call.state))
        except BaseException as err:  # MemoryError, RecursionError, a tool's SystemExit: all the call's own
            try:
                conn.send(("error", idx, f"{type(err).__name__}: {str(err)[:500]}"))
            except Exception:  # the state did not pickle, or the pipe is gone: the parent sees a dead worker
                return


class _Worker:
    def __init__(self, ctx: Any, specs: list[ToolSpec], memory_mb: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, specs, memory_mb), daemon=True,
                                name="spmdrl-tool")
        self.proc.start()
        child.close()
        self.ready = False
        self.born = time.monotonic()
        self.item: Optional[int] = None
        self.started = 0.0

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


class ToolRunner:
    """``num_workers`` processes that execute tool calls, one call each at a time."""

    def __init__(self, specs: Sequence[ToolSpec], *, num_workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: int = 1024) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"tool workers need num_workers >= 1 and timeout_s > 0 (got {num_workers}, {timeout_s})")
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.specs = list(specs)
        self.names = {s.name for s in self.specs}
        self.num_workers, self.timeout_s, self.memory_mb = num_workers, timeout_s, memory_mb
        self.workers: list[_Worker] = []

    def _spawn(self) -> _Worker:
        return _Worker(self.ctx, self.specs, self.memory_mb)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._spawn()

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Results aligned with ``calls``; a failure is a result with ``error`` set, never an exception."""
        results = [ToolResult(state=c.state) for c in calls]
        pending = deque(i for i, c in enumerate(calls) if c.name in self.names)
        for i, c in enumerate(calls):
            if c.name not in self.names:
                results[i].error = f"unknown tool {c.name!r}; available: {', '.join(sorted(self.names))}"
        if pending:
            while len(self.workers) < min(self.num_workers, len(pending)):
                self.workers.append(self._spawn())
        while pending or any(w.item is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.item is None and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send((idx, calls[idx]))
                        w.item, w.started = idx, time.monotonic()
                    except OSError:  # died while idle: retry the call on its replacement
                        pending.appendleft(idx)
                        self._replace(w)
                    except Exception as err:  # the call's arguments or state do not pickle
                        results[idx].error = f"{type(err).__name__}: {err}"
            now = time.monotonic()
            deadlines = [w.started + self.timeout_s for w in self.workers if w.item is not None]
            deadlines += [w.born + _START_TIMEOUT_S for w in self.workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            for w in [w for w in self.workers if w.conn in multiprocessing.connection.wait(
                    [w.conn for w in self.workers], timeout=wait_s)]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the process died (crash, os._exit, memory limit)
                    w.proc.join(timeout=1)
                    if not w.ready:
                        self.close()
                        raise RuntimeError(f"a tool worker exited during start-up (exit code {w.proc.exitcode})")
                    if w.item is not None:
                        results[w.item].error = f"tool worker died (exit code {w.proc.exitcode})"
                    self._replace(w)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    continue
                res = results[msg[1]]
                res.seconds = time.monotonic() - w.started
                if msg[0] == "ok":
                    res.text, res.state = msg[2], msg[3]
                else:
                    res.error = msg[2]
                w.item = None
            now = time.monotonic()
            for w in list(self.workers):
                if w.item is not None and now - w.started >= self.timeout_s:
                    res = results[w.item]
                    res.timed_out, res.seconds = True, now - w.started
                    res.error = f"timed out after {self.timeout_s:g} s"
                    self._replace(w)
                elif not w.ready and now - w.born >= _START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"a tool worker did not start within {_START_TIMEOUT_S:g} s")
        for res in results:
            if res.error:
                res.text = f"Error: {res.error}"
        return results

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
