"""Padded vs packed sequences, fixed vs token-budget micro-batches: an FSDP2 actor's update and log-prob pass.

    python bench/packing.py                        # tiny model, bf16 compute on CPU, 64 rows
    python bench/packing.py --size small --rows 32 --dtype float32

Rows have long-tailed lengths (prompts and responses drawn from an exponential, capped at the maximum) and,
as a control, every row full. Each row of the table is the fastest of ``--repeats`` timings of
``train_step`` (forward + backward + AdamW of one mini-batch) and ``forward_no_grad`` (log-probs), on one
process (world of 1, gloo), with the model's attention kernel resolved as the engine's "auto" does.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.builtin.models import build_model
from spmdrl.engines.fsdp2.engine import FSDP2Engine, resolve_attn_implementation
from spmdrl.parallel import ParallelDims


def make_batch(rows: int, prompt: int, resp: int, full: bool, vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    if full:
        p_len, r_len = torch.full((rows,), prompt), torch.full((rows,), resp)
    else:  # long-tailed: mean about a quarter of the maximum
        p_len = (torch.empty(rows).exponential_(4.0 / prompt, generator=g)).long().clamp(4, prompt)
        r_len = (torch.empty(rows).exponential_(4.0 / resp, generator=g)).long().clamp(1, resp)
    pos = torch.arange(prompt + resp)
    attn = ((pos >= prompt - p_len[:, None]) & (pos < prompt + r_len[:, None])).long()  # [N, P+R]
    return Batch(dict(
        input_ids=torch.randint(3, vocab, (rows, prompt + resp), generator=g) * attn,
        attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=attn[:, prompt:].float(), advantages=torch.randn(rows, resp, generator=g),
    ))


def pg_loss(outputs, mb, scale):
    loss = -(outputs["logp"] * mb["advantages"] * mb["response_mask"]).sum() / scale.global_tokens
    return loss, {}


def timed(fns: list, repeats: int) -> list[float]:
    """The fastest of ``repeats`` timings of each function, taken round-robin, so a burst of load from
    another process on a shared machine slows one repeat of every layout rather than one layout."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16, help="rows per fixed micro-batch")
    ap.add_argument("--budget", type=int, default=0, help="tokens per micro-batch (0: micro x mean row)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build_model(Path(tempfile.mkdtemp()) / "m", args.size)
    mesh = ParallelDims(1).build().fsdp_mesh
    attn = resolve_attn_implementation("auto", "cpu", args.prompt + args.response)
    print(f"{args.size} model, {args.rows} rows of <= {args.prompt} + {args.response} tokens, "
          f"{args.dtype} compute, attention {attn}, {torch.get_num_threads()} threads")
    print(f"{'rows':<12} {'layout':<8} {'micro':<14} {'update s':>9} {'logp s':>8} {'x padded':>9}")
    layouts = ((False, False), (True, False), (False, True), (True, True))
    for full in (False, True):
        batch = make_batch(args.rows, args.prompt, args.response, full, 2048)
        tokens = int(batch["attention_mask"].sum())
        budget = args.budget or args.micro * tokens // args.rows
        fns = []
        for packed, dyn in layouts:
            eng = FSDP2Engine(str(model), role="actor", dp_mesh=mesh, device="cpu", lr=1e-6,
                              param_dtype=args.dtype, attn_implementation=attn, remove_padding=packed)
            kw = dict(max_token_len=budget) if dyn else {}
            fns += [lambda e=eng, kw=kw: e.train_step(batch, pg_loss, args.rows, args.micro, **kw),
                    lambda e=eng, kw=kw: e.forward_no_grad(batch, args.micro, **kw)]
        times = timed(fns, args.repeats)
        name = "full" if full else f"tail {tokens / batch['attention_mask'].numel():.0%}"
        base = times[0] + times[1]
        for i, (packed, dyn) in enumerate(layouts):
            upd, fwd = times[2 * i], times[2 * i + 1]
            micro = f"{budget} tokens" if dyn else f"{args.micro} rows"
            print(f"{name:<12} {'packed' if packed else 'padded':<8} {micro:<14} {upd:9.3f} {fwd:8.3f} "
                  f"{base / (upd + fwd):9.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
