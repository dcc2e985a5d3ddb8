"""Run many short trainings in one torchrun job: the combination matrix's driver (tests/e2e/test_matrix.py).

    torchrun --standalone --nproc-per-node 2 tests/e2e/matrix_driver.py CASES.json RESULTS.json

CASES.json is a list of ``{"name": ..., "argv": [...]}``; each case goes through what
``python -m spmdrl.train`` does (``parse_config``, ``validate_config``, the output lock, ``ParallelDims``,
then ``loop.run``, or ``split.run_split`` under ``rollout.placement split``) on the same process group, so
the ranks start once for all of them instead of once per run (~10 s each on 2 cores); each case builds its
own meshes and, under split placement, its own process groups. A case whose config is refused (ConfigError
before any model is built) records the sentence and the next one runs. Any other error ends the job at
once, after rank 0 wrote what ran so far and the error: the ranks may disagree about where they are, so
nothing after it can be trusted.
``rollout.engine: scripted`` is the deterministic tool-calling policy of ``scripted_policy.py``;
``rollout.engine: colocated_only`` is the same policy as an engine that does not declare ``runs_split``
(every shipped engine does), for the refusal a new backend meets under split placement.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scripted_policy import ScriptedRollout  # noqa: E402

from spmdrl.checkpoint.run_folder import OutputLock  # noqa: E402
from spmdrl.config import output_dir  # noqa: E402
from spmdrl.config.checks import validate_config  # noqa: E402
from spmdrl.config.parse import parse_config  # noqa: E402
from spmdrl.errors import ConfigError  # noqa: E402
from spmdrl.rollout import ROLLOUT_ENGINES  # noqa: E402


class ColocatedOnlyRollout(ScriptedRollout):
    runs_split = False  # RolloutEngine's default


ROLLOUT_ENGINES["scripted"] = lambda: ScriptedRollout
ROLLOUT_ENGINES["colocated_only"] = lambda: ColocatedOnlyRollout


def run_case(argv: list[str]) -> dict:
    """One case as ``spmdrl.train.main`` runs it: refused with its sentence, or trained."""
    import torch.distributed as dist

    from spmdrl.loop import run
    from spmdrl.parallel import ParallelDims, init_distributed, resolve_device_type
    from spmdrl.split import run_split

    start = time.perf_counter()
    try:
        cfg, _ = parse_config(argv)
        validate_config(cfg, int(os.environ["WORLD_SIZE"]))
    except ConfigError as err:
        return {"status": "refused", "message": str(err), "seconds": time.perf_counter() - start}
    lock = OutputLock.acquire(output_dir(cfg)) if os.environ["RANK"] == "0" else None
    try:
        device_type = resolve_device_type(cfg.trainer.device)
        _, world_size = init_distributed(device_type)
        dims = ParallelDims.of(cfg, world_size, device_type=device_type).build()
        (run_split if dims.split else run)(cfg, dims, None)  # None: build() makes the memory plan
    finally:
        if lock is not None:
            lock.release()
    dist.barrier()
    return {"status": "ran", "seconds": time.perf_counter() - start}


def main(cases_file: str, results_file: str) -> int:
    import torch.distributed as dist

    cases = json.loads(Path(cases_file).read_text())
    rank0 = os.environ["RANK"] == "0"
    results: dict[str, dict] = {}

    def write() -> None:
        if rank0:
            Path(results_file).write_text(json.dumps(results, indent=1))

    for case in cases:
        print(f"[matrix] {case['name']}: {' '.join(case['argv'])}", flush=True)
        try:
            results[case["name"]] = run_case(case["argv"])
        except BaseException as err:
            results[case["name"]] = {"status": "crashed", "message": f"{type(err).__name__}: {err}",
                                     "traceback": traceback.format_exc()[-3000:]}
            write()
            print(results[case["name"]]["traceback"], file=sys.stderr, flush=True)
            os._exit(1)
        write()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as spmdrl.train: no interpreter finalization after a finished multi-rank job


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
