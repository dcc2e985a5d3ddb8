"""Run a function on k gloo ranks in separate processes and collect what each returns.

The ranks are kept for the session, one set per world size: starting a process that imports torch costs
seconds on 2 cores, and the tier calls ``spawn`` about fifty times. Each call still gets a fresh process
group (a new port) and the global RNG state a new process starts with; Megatron's global groups, which
die with the call's process group, are dropped after it. A call that fails on any rank, or a rank that
dies, ends that set of ranks (the others may sit in a collective); the next call starts a new one.
"""

from __future__ import annotations

import atexit
import os
import queue as queue_module
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, tasks, results) -> None:
    """A rank's loop: run each task on a new process group, put ("ok", value) or ("error", traceback)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fresh_rng = torch.get_rng_state()  # a new process's global RNG state, for every call
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, port, args = task
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_rng_state(fresh_rng)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - reported to the caller, which ends these ranks
            results.put((rank, "error", traceback.format_exc()))
        finally:
            _drop_megatron_groups()
            dist.destroy_process_group()


def _drop_megatron_groups() -> None:
    import sys

    if "megatron.core.parallel_state" in sys.modules:
        ps = sys.modules["megatron.core.parallel_state"]
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()


class _Ranks:
    """``world_size`` serving processes, each with its task queue, and one queue of results."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        # Not daemonic: a rank may start processes of its own (reward workers); close_all ends them.
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def call(self, fn: Callable, args: tuple) -> list[Any]:
        port = free_port()
        for q in self.tasks:
            q.put((fn, port, args))
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            try:
                rank, status, value = self.results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} of {fn.__name__} died (exit codes "
                                       f"{[self.procs[r].exitcode for r in dead]})") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {fn.__name__} raised:\n{value}")
            got[rank] = value
        return [got[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_RANKS: dict[int, _Ranks] = {}


@atexit.register
def close_all() -> None:
    """End every kept set of ranks."""
    for ranks in _RANKS.values():
        ranks.close()
    _RANKS.clear()


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank (gloo, 127.0.0.1); returns results in rank order.

    ``fn`` must be a module-level function. Results travel through a queue, so return plain Python values
    or numpy arrays (a torch tensor would be shared through a file descriptor the rank may close).
    """
    ranks = _RANKS.get(world_size)
    if ranks is None:
        ranks = _RANKS[world_size] = _Ranks(world_size)
    try:
        return ranks.call(fn, args)
    except BaseException:
        ranks.close()  # the other ranks may be waiting in a collective: start afresh next time
        del _RANKS[world_size]
        raise


def assert_metrics_close(a: dict[str, float], b: dict[str, float], tol: float, norm_tol: float) -> None:
    """The same metric keys, each within ``tol`` (grad norms within ``norm_tol``), relative above 1: one
    layout's update metrics against another's."""
    assert sorted(a) == sorted(b)
    for k in a:
        t = norm_tol if k.endswith("grad_norm") else tol
        assert abs(a[k] - b[k]) <= t * max(1.0, abs(a[k])), (k, a[k], b[k])
