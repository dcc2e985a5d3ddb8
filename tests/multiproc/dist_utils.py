"""Run a function on k gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, queue, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank (gloo, 127.0.0.1); returns results in rank order.

    ``fn`` must be a module-level function. Results travel through a queue
    after the rank has exited, so return plain Python values or numpy arrays
    (a torch tensor would be shared through a file descriptor that dies with the rank).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(fn, world_size, free_port(), queue, args), nprocs=world_size,
                       start_method="spawn", join=True)
    results = dict(queue.get() for _ in range(world_size))
    return [results[r] for r in range(world_size)]
