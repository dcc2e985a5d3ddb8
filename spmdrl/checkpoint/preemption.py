"""Preemption: SIGTERM / SIGUSR1 become "checkpoint and stop at the next step boundary", decided by every rank
together, plus a fault-injection hook for the tests.

    preemption = Preemption()                  # collective; installs the handlers on the main thread
    ...after each step: stop = preemption.stop_requested(step); if ckpt.due(step) or stop: ckpt.save(step)

A handler only sets a flag: the step in flight finishes, then an all-reduce at
the boundary tells every rank whether any rank was signalled, so all of them
save the same step and exit together.

Test hook: ``SPMDRL_FAULT_INJECT_STEP=N`` makes rank ``SPMDRL_FAULT_INJECT_RANK``
(default 1) send itself ``SPMDRL_FAULT_INJECT_SIGNAL`` (default SIGKILL) at the end
of step N, after the stop check, on torchrun's first attempt only. With SIGTERM the
stop is seen at the next boundary, as for a signal that lands mid-step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("spmdrl")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The stop flag of this rank and the all-reduced decision at each step boundary (collective)."""

    def __init__(self, install_signal_handlers: bool = True,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        """``group``: the CPU group that decides (default the world; under split placement the training
        ranks, which hear of a rollout rank's signal with its batch)."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._signal: Optional[int] = None
        # The decision is a CPU tensor; NCCL has no CPU group of its own.
        if group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        self._pg = group
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the step finishes, then every rank agrees to save and stop (stop_requested).
        if self._signal is None:  # os.write: print/logging may not be re-entered from a handler
            name = signal.Signals(signum).name
            os.write(2, f"[rank {self.rank}] {name}: checkpoint and stop at the end of this step\n".encode())
        self._signal = signum

    @property
    def signalled(self) -> bool:
        """Whether this rank got SIGTERM/SIGUSR1."""
        return self._signal is not None

    def stop_requested(self, step: int, elsewhere: bool = False) -> bool:
        """True on every rank when any rank got SIGTERM/SIGUSR1 (all-reduced at the end of ``step``), or
        ``elsewhere`` on any rank (a rank outside the group that said so)."""
        flag = torch.tensor([int(self.signalled or elsewhere)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        self._maybe_inject_fault(step)
        return bool(flag.item())

    def _maybe_inject_fault(self, current: int) -> None:
        step = os.environ.get("SPMDRL_FAULT_INJECT_STEP")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step is None or int(step) != current or not first_attempt:
            return
        rank = int(os.environ.get("SPMDRL_FAULT_INJECT_RANK", min(1, self.world_size - 1)))
        if rank == self.rank:
            sig = signal.Signals[os.environ.get("SPMDRL_FAULT_INJECT_SIGNAL", "SIGKILL")]
            log.warning("SPMDRL_FAULT_INJECT_STEP=%s: rank %d sends itself %s", step, rank, sig.name)
            os.kill(os.getpid(), sig)
