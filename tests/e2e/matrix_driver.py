"""Run many short trainings in one torchrun job: the combination matrix's driver (tests/e2e/test_matrix.py),
and the shared runs' (tests/e2e/shared_runs.py).

    torchrun --standalone --nproc-per-node 2 tests/e2e/matrix_driver.py CASES.json RESULTS.json

CASES.json is a list of ``{"name": ..., "argv": [...]}``. Each case goes through what ``python -m
spmdrl.train`` does (``parse_config``, ``validate_config``, the output lock, ``ParallelDims``, then
``loop.run``, or ``split.run_split`` under ``rollout.placement split``) on the same process group, so the
ranks start once for all of them instead of once per run (~10 s each on 2 cores); each case builds its own
meshes and, under split placement, its own process groups. A case whose config is refused (ConfigError
before any model is built, or, as spmdrl.train exits 2 for it, once files are read) records the sentence
and the next one runs. Any other error ends the job at once,
after rank 0 wrote what ran so far and the error: the ranks may disagree about where they are, so nothing
after it can be trusted.

A case may also hold (the shared runs' do, tests/e2e/shared_runs.py):
- ``"env"``: variables set for that case only (the fault-injection hook's, say);
- ``"logs"``: a folder; the case's stdout and stderr go to ``NAME.rankR.stdout`` / ``.stderr`` there, file
  descriptors included, as if it ran alone;
- ``"fresh": true``: dynamo's compiled kernels dropped first, as in a new process;
- ``"copy": [SRC, DST]``: rank 0 copies an earlier case's folder first (a resume that must leave what the
  stopped run left as it was);
- ``"sft": true``: the case is ``spmdrl.sft``'s (its config, checks and loop);
- ``"stale": RESULTS``: the case is ``stale_driver.py``'s scripted stale run instead (a job of one rank).

``rollout.engine: scripted`` is the deterministic tool-calling policy of ``scripted_policy.py``;
``rollout.engine: colocated_only`` is the same policy as an engine that does not declare ``runs_split``
(every shipped engine does), for the refusal a new backend meets under split placement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

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


def run_case(argv: list[str], sft: bool = False) -> dict:
    """One case as ``spmdrl.train``'s main (``sft``: ``spmdrl.sft``'s) runs it: refused with its
    sentence, or trained."""
    from dataclasses import asdict

    import torch.distributed as dist

    from spmdrl.loop import run
    from spmdrl.parallel import ParallelDims, init_distributed, resolve_device_type
    from spmdrl.plan import heap
    from spmdrl.sft.config import check_sft_config, parse_sft_config
    from spmdrl.sft.loop import run as run_sft
    from spmdrl.split import run_split

    start = time.perf_counter()
    try:
        cfg, _ = (parse_sft_config if sft else parse_config)(argv)
        (check_sft_config if sft else validate_config)(cfg, int(os.environ["WORLD_SIZE"]))
    except ConfigError as err:
        return {"status": "refused", "message": str(err), "seconds": time.perf_counter() - start}
    lock = OutputLock.acquire(output_dir(cfg)) if os.environ["RANK"] == "0" else None
    try:
        device_type = resolve_device_type(cfg.trainer.device)
        if device_type == "cpu":  # as the mains do
            heap.return_large_frees()
        _, world_size = init_distributed(device_type)
        try:
            if sft:
                dims = ParallelDims(world_size, **asdict(cfg.parallel), device_type=device_type).build()
                run_sft(cfg, dims)
            else:
                dims = ParallelDims.of(cfg, world_size, device_type=device_type).build()
                (run_split if dims.split else run)(cfg, dims, None)  # None: build() makes the memory plan
        except ConfigError as err:  # found by every rank at the same point once files are read: exit 2
            dist.barrier()
            return {"status": "refused", "message": str(err), "seconds": time.perf_counter() - start}
    finally:
        if lock is not None:
            lock.release()
    dist.barrier()
    return {"status": "ran", "seconds": time.perf_counter() - start}


@contextlib.contextmanager
def case_env(env: dict[str, str]) -> Iterator[None]:
    """``env`` in os.environ for the case, then the job's own values back."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def case_logs(folder: str | None, name: str) -> Iterator[None]:
    """This rank's stdout and stderr (the descriptors, so that C++ and os.write land there too) into the
    case's own files in ``folder``; nothing when None."""
    if folder is None:
        yield
        return
    rank = os.environ["RANK"]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(Path(folder) / f"{name}.rank{rank}.stdout", "w") as out, \
            open(Path(folder) / f"{name}.rank{rank}.stderr", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def copy_folder(src: str, dst: str) -> None:
    """Rank 0 copies ``src`` to ``dst``; every rank waits for it."""
    import torch.distributed as dist

    from spmdrl.parallel import init_distributed

    init_distributed("cpu")
    if os.environ["RANK"] == "0":
        shutil.copytree(src, dst)
    dist.barrier()


def run_stale(results: str, argv: list[str]) -> dict:
    from stale_driver import scripted_stale

    from spmdrl.parallel import init_distributed

    start = time.perf_counter()
    init_distributed("cpu")
    scripted_stale(results, argv)
    return {"status": "ran", "seconds": time.perf_counter() - start}


def main(cases_file: str, results_file: str) -> int:
    import torch
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
            if "copy" in case:
                copy_folder(*case["copy"])
            if case.get("fresh"):
                # Kernels compiled for an earlier case (another dtype or shape) can round differently
                # from the ones a fresh process compiles: a run compared bitwise with a run in another
                # job must compile its own.
                torch._dynamo.reset()
            with case_env(case.get("env", {})), case_logs(case.get("logs"), case["name"]):
                if "stale" in case:
                    results[case["name"]] = run_stale(case["stale"], case["argv"])
                else:
                    results[case["name"]] = run_case(case["argv"], sft=case.get("sft", False))
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
