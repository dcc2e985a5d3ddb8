"""Worker processes that run user code one item at a time, each item on its own clock.

    pool = WorkerPool(setup, [arg], num_workers=2, timeout_s=10.0, name="reward", start_timeout_s=60)
    outcomes = pool.run(items)   # aligned with items: .value, .error, .timed_out, .seconds
    pool.close()

``setup(*setup_args)`` (a module-level function, named to the worker as ``module:function``) runs once
in every fresh worker (import the user's function, build tools) and returns the handler that is called
on each item; the handler's return value comes back as ``value``. Items, setup arguments and values are
plain data: they cross the process boundary as JSON frames (``spmdrl.sandbox.frames``), never pickle, so
a subverted worker can send the trainer wrong data but no code. An item whose handler raises (anything,
``SystemExit`` and ``MemoryError`` included) or whose value is not JSON or is over ``max_reply_bytes``
comes back with ``error`` set; an item that runs past ``timeout_s`` (counted from when it is sent), whose
worker dies (segfault, ``os._exit``, a limit) or whose worker sends a malformed or oversized frame comes
back with ``error`` set too, and its worker's whole process group is killed and the worker replaced, so
one bad item costs only itself. The trainer never blocks on a worker: pipes are non-blocking and read
under ``select`` with the nearest deadline, a frame that is still incomplete at its item's deadline is a
timeout, and a reply whose id is not the worker's current item is dropped. A worker that dies or hangs
while starting means the setup itself is broken: ``run`` raises (with the end of its output), since every
replacement would repeat it.

Each worker is a fresh interpreter (``python -m spmdrl.sandbox.worker``) in its own session, temporary
directory and allowlisted environment, confined as ``spmdrl.sandbox.confine`` describes at ``level``
``process`` or ``isolated``. Used by ``spmdrl.reward.rule`` (scoring) and ``spmdrl.agent.runner`` (tools).
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from spmdrl.sandbox.confine import Limits, kill_tree, worker_env
from spmdrl.sandbox.frames import FrameError, FrameReader, encode

MAX_REPLY_BYTES = 16 * 1024 * 1024
_LOG_TAIL_BYTES = 2000  # of a worker's output, quoted when it fails to start


@dataclass
class Outcome:
    """What became of one item: ``value`` when ``error`` is empty."""

    value: Any = None
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0  # from when the item was sent until its answer, death or timeout


class _Worker:
    """One worker process, its pipes and its work directory."""

    def __init__(self, setup_frame: dict, name: str, max_reply_bytes: int) -> None:
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix=f"spmdrl-{name}-"))
        self.log_path = os.path.join(self.workdir, "output.log")
        reply_r, reply_w = os.pipe()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spmdrl.sandbox.worker", str(reply_w)], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=worker_env(self.workdir),
                pass_fds=(reply_w,), start_new_session=True)
        os.close(reply_w)
        self.rfd = reply_r
        self.wfd = self.proc.stdin.fileno()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.reader = FrameReader(max_reply_bytes)
        self.outbox = encode({**setup_frame, "workdir": self.workdir})
        self.ready = False
        self.born = time.monotonic()
        self.item: Optional[int] = None  # index of the item being handled
        self.seq = -1  # id the reply to that item must carry
        self.started = 0.0  # when that item was sent

    def send(self, idx: int, seq: int, frame: bytes) -> None:
        self.outbox += frame
        self.item, self.seq, self.started = idx, seq, time.monotonic()

    def flush(self) -> None:
        """Write what the pipe takes now (BrokenPipeError when the worker is gone)."""
        try:
            written = os.write(self.wfd, self.outbox)
        except BlockingIOError:
            return
        self.outbox = self.outbox[written:]

    def output_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - _LOG_TAIL_BYTES))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the worker's every descendant, its process group and itself; reap it; clean up."""
        kill_tree(self.proc.pid, including_root=False)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the kernel
            pass
        for close in (lambda: os.close(self.rfd), self.proc.stdin.close):
            try:
                close()
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stop(self) -> None:
        """Close its stdin (it exits when idle), give it a moment, then kill what is left."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class WorkerPool:
    """Up to ``num_workers`` processes, each fed one item at a time and replaced when it hangs or dies.

    ``name`` ("reward", "tool") names the processes and the messages; ``timeout_note`` (a config key)
    is added to timeout messages and ``context`` to start-up errors. Workers start on the first
    ``run`` that needs them and are kept for later ones.
    """

    def __init__(self, setup: Callable[..., Callable[[Any], Any]], setup_args: Sequence[Any], *,
                 num_workers: int, timeout_s: float, name: str, start_timeout_s: float,
                 timeout_note: str = "", context: str = "", limits: Optional[Limits] = None,
                 level: str = "process", max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        limits = limits or Limits()
        if limits.cpu_s is None:
            limits = dataclasses.replace(limits, cpu_s=max(60, 4 * math.ceil(timeout_s)))
        self.setup_frame = {"setup": f"{setup.__module__}:{setup.__qualname__}", "args": list(setup_args),
                            "limits": dataclasses.asdict(limits), "level": level,
                            "max_reply_bytes": max_reply_bytes}
        encode(self.setup_frame)  # setup arguments that are not plain data fail here, not in a worker
        self.name, self.max_reply_bytes = name, max_reply_bytes
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, timeout_s, start_timeout_s
        self.timeout_note = f" ({timeout_note})" if timeout_note else ""
        self.context = context
        self.workers: list[_Worker] = []
        self.seq = 0
        self.dropped = 0  # replies that named an item their worker was not handling

    def _spawn(self) -> _Worker:
        return _Worker(self.setup_frame, self.name, self.max_reply_bytes)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._spawn()

    def _start_failed(self, w: _Worker, what: str, detail: str = "") -> RuntimeError:
        tail = w.output_tail()
        self.close()
        notes = ", ".join(n for n in (detail, self.context) if n)
        return RuntimeError(f"a {self.name} worker {what}" + (f" ({notes})" if notes else "")
                            + (f"; its output ends with:\n{tail}" if tail else ""))

    def _fail(self, w: _Worker, out: Outcome, error: str, timed_out: bool = False) -> None:
        out.error, out.timed_out, out.seconds = error, timed_out, time.monotonic() - w.started
        self._replace(w)

    def _assign(self, items: Sequence[Any], pending: deque, outcomes: list[Outcome]) -> None:
        for w in self.workers:
            while w.ready and w.item is None and pending:
                idx = pending.popleft()
                self.seq += 1
                try:
                    frame = encode({"id": self.seq, "item": items[idx]})
                except (TypeError, ValueError, RecursionError) as err:
                    outcomes[idx].error = f"the item is not plain data (JSON): {err}"
                    continue
                w.send(idx, self.seq, frame)

    def _wait(self) -> tuple[list[int], list[int]]:
        """Readable and writable pipe ends, waiting at most until the nearest deadline."""
        deadlines = [w.started + self.timeout_s for w in self.workers if w.item is not None]
        deadlines += [w.born + self.start_timeout_s for w in self.workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        writers = [w.wfd for w in self.workers if w.outbox]
        readable, writable, _ = select.select([w.rfd for w in self.workers], writers, [], wait_s)
        return readable, writable

    def _receive(self, w: _Worker, outcomes: list[Outcome]) -> None:
        """Read what ``w`` sent and act on each whole frame."""
        try:
            chunk = os.read(w.rfd, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:  # the process died (crash, os._exit, a limit, the OOM killer) or closed its pipe
            try:
                w.proc.wait(timeout=1)  # reap it, so the exit code is known for the message
            except subprocess.TimeoutExpired:
                pass
            if not w.ready:
                raise self._start_failed(w, "exited during start-up", f"exit code {w.proc.returncode}")
            if w.item is not None:
                self._fail(w, outcomes[w.item], f"{self.name} worker died (exit code {w.proc.returncode})")
            else:
                self._replace(w)
            return
        try:
            frames = w.reader.feed(chunk)
        except FrameError as err:
            if not w.ready:
                raise self._start_failed(w, "sent a malformed frame", str(err)) from None
            if w.item is not None:
                self._fail(w, outcomes[w.item], f"{self.name} worker sent a malformed reply: {err}")
            else:
                self._replace(w)
            return
        for frame in frames:
            if not w.ready and frame == {"ready": True}:
                w.ready = True
            elif w.item is not None and isinstance(frame, dict) and frame.get("id") == w.seq and (
                    "ok" in frame or isinstance(frame.get("error"), str)):
                out = outcomes[w.item]
                out.seconds = time.monotonic() - w.started
                out.value, out.error = frame.get("ok"), frame.get("error", "")
                w.item = None
            else:  # not a reply to the item this worker holds: a forged or stale id
                self.dropped += 1

    def _expire(self, outcomes: list[Outcome]) -> None:
        now = time.monotonic()
        for w in list(self.workers):
            if w.item is not None and now - w.started >= self.timeout_s:
                partial = " with its reply incomplete" if w.reader.partial else ""
                self._fail(w, outcomes[w.item], f"timed out after {self.timeout_s:g} s{partial}"
                                                f"{self.timeout_note}", timed_out=True)
            elif not w.ready and now - w.born >= self.start_timeout_s:
                raise self._start_failed(w, f"did not start within {self.start_timeout_s:g} s")

    def run(self, items: Sequence[Any]) -> list[Outcome]:
        """Outcomes aligned with ``items``; a failing item is an outcome with ``error`` set, never an
        exception."""
        outcomes = [Outcome() for _ in items]
        while len(self.workers) < min(self.num_workers, len(items)):
            self.workers.append(self._spawn())
        pending = deque(range(len(items)))
        while pending or any(w.item is not None for w in self.workers):
            self._assign(items, pending, outcomes)
            readable, writable = self._wait()
            for w in list(self.workers):
                if w.wfd in writable:
                    try:
                        w.flush()
                    except OSError:  # broken pipe: it died before taking its item (killed while idle)
                        w.outbox = b""
                        if w.ready:  # a worker that never started is reported by its reply pipe
                            if w.item is not None:
                                pending.appendleft(w.item)
                            self._replace(w)
                            continue
                if w.rfd in readable:
                    self._receive(w, outcomes)
            self._expire(outcomes)
        return outcomes

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
