"""Write a built-in synthetic task as verl-layout parquet files (nothing is downloaded).

    python -m spmdrl.tools.make_task --out /tmp/arith --task arith --train-size 8192 --val-size 128 --seed 0

Writes ``OUT/train.parquet`` and ``OUT/val.parquet``; each file is written to a
temporary name and renamed, so a reader never sees half a file. The same task,
sizes and seed always give the same rows (see ``spmdrl.tasks``).

The default configs say ``data.train_files: builtin:arith``;
``resolve_builtin_data`` builds those files under the cache on first use
(rank 0 builds, the others wait).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from spmdrl.tasks import TASKS, Row, get_task
from spmdrl.tools.tiny_model import cache_dir

DEFAULT_TRAIN_SIZE = 8192
DEFAULT_VAL_SIZE = 128
# Bump when a generator or the default sizes change, so stale cached files are not reused.
BUILTIN_DATA_VERSION = 2
SPLITS = ("train", "val")


def write_parquet(rows: list[Row], path: Path) -> Path:
    """Write ``rows`` (dicts) to ``path`` atomically: a temporary file in the same folder, then a rename."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def make_task(
    out: Path, task: str = "arith", train_size: int = DEFAULT_TRAIN_SIZE, val_size: int = DEFAULT_VAL_SIZE,
    seed: int = 0,
) -> dict[str, Path]:
    """Write ``out/train.parquet`` and ``out/val.parquet`` for ``task``; return {split: path}."""
    generate = get_task(task)
    sizes = {"train": train_size, "val": val_size}
    for split, num in sizes.items():
        if num < 1:
            raise ValueError(f"--{split}-size must be at least 1, got {num}")
    return {split: write_parquet(generate(split, num, seed), Path(out) / f"{split}.parquet")
            for split, num in sizes.items()}


def resolve_builtin_data(spec: str, split: str, seed: int = 0) -> str:
    """Map ``builtin:<task>`` to the cached parquet file of ``split``, building it when missing.

    Other specs (file paths) pass through unchanged. Call on every rank: rank 0
    builds, the others wait at a barrier when torch.distributed is initialised.
    """
    if not spec.startswith("builtin:"):
        return spec
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for {spec!r}; valid splits: {', '.join(SPLITS)}")
    task = spec.split(":", 1)[1]
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {spec!r}; valid: {', '.join('builtin:' + t for t in sorted(TASKS))}")
    import torch.distributed as dist

    folder = cache_dir() / "data" / f"{task}-v{BUILTIN_DATA_VERSION}-seed{seed}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Both files are renamed into place only when complete, so existence means done.
    if rank == 0 and not all((folder / f"{s}.parquet").exists() for s in SPLITS):
        make_task(folder, task, seed=seed)
    if dist.is_initialized():
        dist.barrier()
    return str(folder / f"{split}.parquet")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for train.parquet and val.parquet")
    p.add_argument("--task", default="arith", choices=sorted(TASKS))
    p.add_argument("--train-size", type=int, default=DEFAULT_TRAIN_SIZE)
    p.add_argument("--val-size", type=int, default=DEFAULT_VAL_SIZE)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    paths = make_task(Path(args.out), args.task, args.train_size, args.val_size, args.seed)
    for split, path in paths.items():
        print(f"wrote {path} ({args.train_size if split == 'train' else args.val_size} rows, task={args.task})")


if __name__ == "__main__":
    main()
