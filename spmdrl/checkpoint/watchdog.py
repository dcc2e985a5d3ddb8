"""The hang watchdog: a rank that makes no progress for ``trainer.hang_timeout_s`` says so, writes the Python
stacks of all its threads to stderr and exits with code 3, instead of waiting silently in a collective.

    watchdog = Watchdog(cfg.trainer.hang_timeout_s, rank, world_size)
    timer = PhaseTimer(device, on_phase=watchdog.beat)   # every phase start is a heartbeat
    ...
    watchdog.close()

Progress is a heartbeat: the start of each phase (weight_sync, rollout, reward, old_logp, ..., checkpoint).
The first heartbeat arms a daemon thread, so building the models is not timed (the process group's own
timeout covers the collectives there). When one rank stalls (a rollout, a reward function, a tool), the
others soon wait for it in a collective and stop beating too, so every rank's watchdog fires within about
the difference of their last heartbeats. A firing rank waits a short grace before it exits, because its exit
breaks the connections its peers wait on and they would end with a plain collective error instead of their
own stacks; torchrun then tears down whatever is left.

The thread only reads a tuple the main thread replaces, and it writes with ``os.write`` and ``faulthandler``
(neither takes a lock the stuck main thread might hold): the sentence and the stacks in one write, so that
ranks stalling together do not interleave their dumps in torchrun's shared stderr. SIGUSR1 and SIGTERM
stay with ``checkpoint.preemption``; this module installs no signal handler.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

HANG_EXIT_CODE = 3
MAX_GRACE_S = 30.0  # how long a firing rank lets blocked peers reach their own deadline
COLLECTIVE_TIMEOUT_S = 1800.0  # the process group's timeout without a watchdog (torch's gloo default)


def collective_timeout_s(hang_timeout_s: Optional[float]) -> float:
    """The process group's timeout: past the watchdog's deadline and grace, so that a rank blocked in a
    collective is ended by its watchdog (phase name and stacks) rather than by a bare timeout error; never
    below ``COLLECTIVE_TIMEOUT_S``, so a short watchdog does not shorten the waits of model loading."""
    if not hang_timeout_s:
        return COLLECTIVE_TIMEOUT_S
    return max(COLLECTIVE_TIMEOUT_S, hang_timeout_s + MAX_GRACE_S + 30.0)


class Watchdog:
    """Heartbeats of this rank and the thread that ends it when they stop (no thread when disabled)."""

    def __init__(self, timeout_s: Optional[float], rank: int, world_size: int = 1, role: str = "") -> None:
        """``role``: what the rank does, named when it fires (``RankRole.label``: "" colocated)."""
        self.timeout_s = float(timeout_s or 0)  # 0 or None: off
        self.rank = rank
        self.who = f"rank {rank} ({role} rank)" if role else f"rank {rank}"
        self.grace_s = min(self.timeout_s, MAX_GRACE_S) if world_size > 1 else 0.0
        self._last = ("start", time.monotonic())  # (phase, when it began): replaced whole, read whole
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self, phase: str) -> None:
        """This rank is starting ``phase``: progress. The first beat starts the watch."""
        self._last = (phase, time.monotonic())
        if self._thread is None and self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="spmdrl-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop watching (the run is over, or ending with its own error)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._done.wait(poll_s):
            phase, since = self._last
            idle = time.monotonic() - since
            if idle >= self.timeout_s:
                self._fire(phase, idle)

    def _fire(self, phase: str, idle: float) -> None:
        said = (f"[rank {self.rank}] spmdrl watchdog: {self.who} made no progress in phase {phase} for "
                f"{int(idle)} s (trainer.hang_timeout_s={self.timeout_s:g}); the Python stacks of its "
                f"threads follow, then it exits with code {HANG_EXIT_CODE}\n").encode()
        os.write(2, said + _stacks())
        if self._done.wait(self.grace_s):
            return  # the main thread finished after all (close() during the grace): nothing to end
        os._exit(HANG_EXIT_CODE)


def _stacks() -> bytes:
    """Every thread's Python stack as faulthandler writes it, gathered in memory first: ranks that stall
    together share torchrun's stderr, and one write each keeps their dumps from interleaving line by line
    (a pipe takes a write of up to 4 KiB whole). Where there is no memfd (not Linux), b"" after dumping
    straight to stderr."""
    if not hasattr(os, "memfd_create"):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return b""
    fd = os.memfd_create("spmdrl-watchdog")
    try:
        faulthandler.dump_traceback(file=fd, all_threads=True)
        size = os.lseek(fd, 0, os.SEEK_CUR)
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, size)
    finally:
        os.close(fd)
