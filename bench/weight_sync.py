"""Weight sync: seconds per ``update_weights`` and bytes/s of the vllm and native engines, against a plain
memcpy of the same bytes, measured in the same run.

    .venv-vllm/bin/python bench/weight_sync.py --model small
    .venv-vllm/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/weight_sync.py --tp 2

The stream is the model folder's weights as full float32 tensors under HF names, which is what the
actor's ``export_weights`` yields (its FSDP all-gathers are not timed here: this is the engine's side).
"memcpy" copies the same tensors into preallocated tensors of the same shapes, the floor for an in-place
update. Rounds interleave the rows (memcpy, native, vllm at each bucket size); figures are medians. Under
``--tp 2`` every rank streams the full tensors and vLLM keeps its shard; native is left out (it does
not shard). One model per process: vLLM's parallel state is per process. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", choices=["tiny", "small"])
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size (run under torchrun for > 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--buckets-mb", type=int, nargs="+", default=[512, 16])
    a = p.parse_args()

    import torch.distributed as dist

    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.parallel import ParallelDims, init_distributed
    from spmdrl.rollout import build_rollout
    from spmdrl.rollout.native.model import Decoder

    rank, world = init_distributed("cpu")
    dims = ParallelDims(world, rollout_tp=a.tp).build()
    path = resolve_builtin_model(f"builtin:{a.model}")
    weights = dict(Decoder.iter_checkpoint(path))  # hf_name -> full float32 tensor
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    engines = {"vllm": build_rollout("vllm", path, mesh=dims.rollout_mesh, dtype=torch.float32,
                                     max_num_seqs=8, max_model_len=128, seed=0)}
    if a.tp == 1:
        engines["native"] = build_rollout("native", path, dtype=torch.float32, max_num_seqs=8)
    dst = {k: torch.empty_like(v) for k, v in weights.items()}
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t)

    for _ in range(a.rounds + 1):  # the first round warms up and is dropped below
        timed("memcpy", lambda: [dst[k].copy_(v) for k, v in weights.items()])
        if "native" in engines:
            timed("native", lambda: engines["native"].update_weights(iter(weights.items())))
        for mb in a.buckets_mb:
            engines["vllm"].options.bucket_bytes = mb << 20
            timed(f"vllm, {mb} MB buckets", lambda: engines["vllm"].update_weights(iter(weights.items())))
    if rank == 0:
        base = statistics.median(times["memcpy"][1:])
        print(f"\nweight sync, {a.model} model ({nbytes / 2**20:.1f} MiB float32, {len(weights)} tensors), "
              f"vLLM TP {a.tp} on {world} rank(s), torch threads {torch.get_num_threads()}, "
              f"{os.cpu_count()} cores; median of {a.rounds} rounds after one warm-up, rows interleaved\n")
        print("| row | s/sync | GB/s | x memcpy time |")
        print("|---|---|---|---|")
        for name, ts in times.items():
            s = statistics.median(ts[1:])
            print(f"| {name} | {s:.4f} | {nbytes / s / 1e9:.2f} | {s / base:.1f} |")
    engines["vllm"].close()


if __name__ == "__main__":
    main()
