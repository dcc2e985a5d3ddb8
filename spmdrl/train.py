"""Entry point: every rank runs this same program.

    torchrun --standalone --nproc-per-node 2 -m spmdrl.train --config configs/grpo.yaml
    python -m spmdrl.train --config configs/grpo.yaml            # a world of one
    python -m spmdrl.train --config configs/grpo.yaml --print_config

Parse and check the config (bad input exits 2 before any process group
exists), make the memory plan (``spmdrl.plan``: a phase that cannot fit exits 2
too; ``--trainer.plan_only true`` prints it and exits here), take the output
folder's lock on rank 0 (a second run on the same folder exits 2 naming the
holder), start torch.distributed, build the meshes, then hand over to the loop
in ``spmdrl.loop``. The process group is torn down
in ``finally`` so a failing rank does not leave the others waiting on a dead
store; the lock is released there too.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from spmdrl.checkpoint.run_folder import OutputLock
from spmdrl.checkpoint.watchdog import collective_timeout_s
from spmdrl.config import Config, output_dir
from spmdrl.config.checks import validate_config
from spmdrl.config.parse import exit_with, parse_config
from spmdrl.errors import ConfigError
from spmdrl.parallel import ParallelDims, RankRole, resolve_device_type
from spmdrl.plan import Plan, heap, make_plans


def main(argv: Optional[Sequence[str]] = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        cfg, debug, plans = checked(argv, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        rank0 = os.environ.get("RANK", "0") == "0"
        if rank0:  # with plan_only, each plan's verdict under it, whether or not the run would fit here
            print("\n".join(p.table() + ("\n" + p.verdict() if cfg.trainer.plan_only else "")
                            for p in plans.values()), flush=True)
        if cfg.trainer.plan_only:
            return 0
        plan = plans[ParallelDims.of(cfg, world_size).role(int(os.environ.get("RANK", "0")))]
        # Rank 0 (the one writer of metrics and config) claims the folder before any model loads.
        lock = OutputLock.acquire(output_dir(cfg)) if os.environ.get("RANK", "0") == "0" else None
    except ConfigError as err:
        exit_with(err, debug)

    from spmdrl.loop import run
    from spmdrl.parallel import init_distributed
    from spmdrl.split import run_split

    finished, code, world_size = False, 0, 1
    try:
        device_type = resolve_device_type(cfg.trainer.device)
        if device_type == "cpu":  # freed activations go back to the OS instead of a fragmented heap
            heap.return_large_frees()
        _, world_size = init_distributed(device_type, collective_timeout_s(cfg.trainer.hang_timeout_s))
        dims = ParallelDims.of(cfg, world_size, device_type=device_type).build()
        # Split placement: rollout and training on their own ranks, overlapped (spmdrl/split/).
        (run_split if dims.split else run)(cfg, dims, plan)
        finished = True
    except ConfigError as err:
        # Problems only visible once files are opened (a bad parquet column, a
        # corrupt checkpoint) are still user errors, found by every rank at the
        # same point: one line, exit 2.
        finished, code = True, 2
        exit_with(err, debug)
    finally:
        if lock is not None:
            lock.release()
        teardown(finished, code, world_size)
    return 0


def checked(argv: Optional[Sequence[str]], world_size: int, local_world_size: int
            ) -> tuple[Config, bool, dict[RankRole, Plan]]:
    """The config of ``argv`` checked for ``world_size`` ranks, whether ``--debug`` was given, and its memory
    plans, one per role (split placement: training and rollout ranks hold different things); a run that
    cannot fit raises ConfigError unless it only asks for the plan. Every rank does this first, and
    spmdrl.launch once before torchrun starts them: bad input is one line there, not a restart loop."""
    cfg, debug = parse_config(argv)
    validate_config(cfg, world_size)
    plans = make_plans(cfg, world_size, local_world_size, resolve_device_type(cfg.trainer.device))
    if not cfg.trainer.plan_only:
        for p in plans.values():
            p.check()  # a phase that cannot fit stops the run before any work
    return cfg, debug, plans


def teardown(finished: bool, code: int, world_size: int) -> None:
    """Leave the process group (``spmdrl.train`` and ``spmdrl.sft`` alike), only when every rank got here:
    after a rank-local crash the others may sit in a collective and destroy would hang; torchrun ends them.
    The barrier keeps a fast rank from closing gloo pairs a slow one still uses."""
    if finished and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if world_size > 1:
            _exit_now(code)


def _exit_now(code: int) -> None:
    """End a finished multi-rank process without interpreter finalization.

    Rarely (seen under load on 2 CPU ranks, after the last step and a clean
    destroy_process_group) a C++ thread of the distributed runtime is destroyed
    unjoined during finalization: "terminate called without an active exception",
    SIGABRT, and torchrun reports a run that completed as failed. Every file,
    logger and reward worker is closed by now (loop.run's finally), so skipping
    finalization loses nothing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
