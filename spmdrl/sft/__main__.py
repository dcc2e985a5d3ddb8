"""Entry point of ``torchrun -m spmdrl.sft``: every rank runs this same program.

    torchrun --standalone --nproc-per-node 2 -m spmdrl.sft --config configs/sft.yaml
    python -m spmdrl.sft --config configs/sft.yaml --print_config

Parse and check the config (bad input exits 2 before any process group exists), take the output folder's
lock on rank 0 (as ``spmdrl.train``: a second run on the same folder exits 2), start torch.distributed,
build the meshes, run ``spmdrl.sft.loop``; bad data files are found on every rank before a model loads and
exit 2 as well. Teardown as ``spmdrl.train`` does it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Optional, Sequence

from spmdrl.checkpoint.run_folder import OutputLock
from spmdrl.config import output_dir
from spmdrl.config.parse import exit_with
from spmdrl.errors import ConfigError
from spmdrl.sft.config import check_sft_config, parse_sft_config


def main(argv: Optional[Sequence[str]] = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cfg, debug = parse_sft_config(argv)
        check_sft_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        lock = OutputLock.acquire(output_dir(cfg)) if os.environ.get("RANK", "0") == "0" else None
    except ConfigError as err:
        exit_with(err, debug, prog="spmdrl.sft")

    from spmdrl.parallel import ParallelDims, init_distributed, resolve_device_type
    from spmdrl.plan import heap
    from spmdrl.sft.loop import run
    from spmdrl.train import teardown

    device_type = resolve_device_type(cfg.trainer.device)
    if device_type == "cpu":  # as spmdrl.train: freed activations go back to the OS (spmdrl/plan/heap.py)
        heap.return_large_frees()
    rank, world_size = init_distributed(device_type)
    finished, code = False, 0
    try:
        dims = ParallelDims(world_size, **asdict(cfg.parallel), device_type=device_type).build()
        run(cfg, dims)
        finished = True
    except ConfigError as err:
        finished, code = True, 2
        exit_with(err, debug, prog="spmdrl.sft")
    finally:
        if lock is not None:
            lock.release()
        teardown(finished, code, world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
