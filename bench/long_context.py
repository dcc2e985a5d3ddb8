"""How long a sequence one training rank takes at SP 1, 2 and 4 (Ulysses, ``parallel.sp``), planned against
measured, and the step time against SP 1 at the same length.

    python bench/long_context.py                                  # builtin:small, SP 1 2 4, cap 4 GB
    python bench/long_context.py --sp 1 2 --lengths 2048 4096 8192 --cap-gb 3

Each cell is a fresh ``torchrun --nproc-per-node sp`` job (this file as its worker): every rank holds one
row of ``length`` tokens (a 256-token prompt, the rest response), so an SP group runs micro-batches of one
row, each rank 1/sp of its tokens, through what a training step does on it: the actor's old log-probs, the
reference's log-probs and the actor's update (GRPO's loss with a KL term), with activation checkpointing and
packed sequences, in bf16 over float32 masters on CPU. Measured: the highest peak RSS of the ranks
(``ru_maxrss``, the process since it started) and each phase's seconds (rank 0). Planned: the memory plan's
(``spmdrl.plan``) largest of those three phases for the same config, less the rollout engine it would hold
asleep (this bench builds none). A length is taken when the measured peak stays under the cap; the
table's last lines give the longest length each SP took.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = 256
GB = 1024**3


def _config_args(length: int, sp: int) -> list[str]:
    """The spmdrl config of one cell (what the plan reads; the worker builds the same engines)."""
    return ["--config", str(REPO / "configs/grpo.yaml"), "--model.path", "builtin:small",
            "--model.max_position_embeddings", str(length), "--data.max_prompt_length", str(PROMPT),
            "--data.max_response_length", str(length - PROMPT), "--data.train_batch_size", str(sp),
            "--rollout.n", "1", "--actor.ppo_mini_batch_size", str(sp),
            "--actor.ppo_micro_batch_size_per_gpu", "1", "--actor.log_prob_micro_batch_size_per_gpu", "1",
            "--ref.log_prob_micro_batch_size_per_gpu", "1", "--model.enable_gradient_checkpointing", "true",
            "--model.use_remove_padding", "true", "--parallel.sp", str(sp)]


def planned(length: int, sp: int) -> float:
    """The plan's peak of the old-log-prob, reference and update phases, without the rollout engine."""
    from spmdrl.config.parse import parse_config
    from spmdrl.plan import make_plan

    cfg, _ = parse_config(_config_args(length, sp))
    plan = make_plan(cfg, sp, sp, "cpu")
    return max(sum(v for k, v in plan.phases[p].items() if not k.startswith("engine"))
               for p in ("old_logp", "ref", "update") if p in plan.phases)


def worker(length: int, sp: int, out: str) -> None:
    """One cell on this rank (under torchrun): the three passes on one row per rank."""
    import torch
    import torch.distributed as dist

    from spmdrl.batch import Batch
    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.config.parse import parse_config
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.objectives import actor_loss_fn
    from spmdrl.parallel import ParallelDims, init_distributed

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))
    rank, world = init_distributed("cpu")
    cfg, _ = parse_config(_config_args(length, sp))  # grpo.yaml's loss: a KL term to the reference
    dims = ParallelDims(world, sp=sp).build()
    path = resolve_builtin_model("builtin:small")
    g = torch.Generator().manual_seed(rank)
    resp = length - PROMPT
    ids = torch.randint(3, 2048, (1, length), generator=g)
    row = Batch(dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                     position_ids=torch.arange(length)[None], response_mask=torch.ones(1, resp),
                     advantages=torch.randn(1, resp, generator=g), ref_logp=torch.full((1, resp), -7.6)))
    kw = dict(dp_mesh=dims.dp_mesh, sp_mesh=dims.sp_mesh, fsdp_mesh=dims.fsdp_mesh, device="cpu",
              param_dtype=torch.bfloat16, attn_implementation="sdpa", remove_padding=True,
              max_position_embeddings=length)
    actor = FSDP2Engine(path, role="actor", gradient_checkpointing=True, lr=1e-6, **kw)
    ref = FSDP2Engine(path, role="ref", **kw)
    times = {}
    for name, fn in (("old_logp", lambda: actor.forward_no_grad(row, 1)),
                     ("ref", lambda: ref.forward_no_grad(row, 1)),
                     ("update", lambda: actor.train_step(row, actor_loss_fn(cfg), 1, 1))):
        start = time.perf_counter()
        result = fn()
        if name == "old_logp":
            row["old_logp"] = result["logp"]
        times[name] = time.perf_counter() - start
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"peak": float(peak), **times}))
    dist.destroy_process_group()


def run_cell(length: int, sp: int, tmp: Path) -> dict | None:
    out = tmp / f"sp{sp}_{length}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}",
           str(Path(__file__).resolve()), "--worker", str(length), str(sp), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0 or not out.exists():
        print(f"sp {sp} length {length}: failed (exit {proc.returncode}): {proc.stderr[-800:]}", flush=True)
        return None
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    p.add_argument("--cap-gb", type=float, default=4.0, help="per-rank peak RSS a length must stay under")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_long_context"))
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), args.worker[2])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"builtin:small, {PROMPT}-token prompt, one row per rank, micro-batches of one row, activation "
          f"checkpointing, bf16 compute; cap {args.cap_gb:g} GB per rank; {os.cpu_count()} CPU(s)")
    print("| sp | length | measured peak GB | planned GB | plan / measured | old_logp s | ref s | update s "
          "| step s vs SP 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    longest: dict[int, int] = {}
    base: dict[int, float] = {}
    for length in args.lengths:
        for sp in args.sp:
            r = run_cell(length, sp, args.out)
            if r is None:
                continue
            plan = planned(length, sp)
            step = r["old_logp"] + r["ref"] + r["update"]
            if sp == 1:
                base[length] = step
            vs = f"{step / base[length]:.2f}x" if length in base else "-"
            print(f"| {sp} | {length} | {r['peak'] / GB:.2f} | {plan / GB:.2f} | {plan / r['peak']:.2f} "
                  f"| {r['old_logp']:.1f} | {r['ref']:.1f} | {r['update']:.1f} | {vs} |", flush=True)
            if r["peak"] < args.cap_gb * GB:
                longest[sp] = max(longest.get(sp, 0), length)
    for sp in args.sp:
        print(f"SP {sp}: longest length under {args.cap_gb:g} GB: {longest.get(sp, '-')}")


if __name__ == "__main__":
    main()
