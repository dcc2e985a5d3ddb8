"""The training side of a GRPO step on long-tailed lengths: padded vs packed rows, fixed vs token-budget
micro-batches, balanced ranks, LoRA. Run on 2 ranks:

    torchrun --standalone --nproc-per-node 2 bench/train_phases.py               # tiny model
    torchrun --standalone --nproc-per-node 2 bench/train_phases.py --size small --rounds 3
    torchrun --standalone --nproc-per-node 2 bench/train_phases.py --workload long-prompts --prompt 256 \
        --response 32 --dtype bfloat16 --only "padded, fixed micro|packed, token budget"

Each rank holds the responses to its own prompts, as after a rollout: groups of ``--n`` responses whose
lengths follow the prompt (a hard prompt gets long answers), prompt and response lengths long-tailed
(exponential, capped: the mean row is about a quarter of the longest, like GSM8K prompts of 40-300 tokens
with answers from 20 tokens to the cap). Every configuration runs the three phases the loop runs on them,
``old_logp`` (actor forward), ``ref`` (reference forward) and ``update`` (2 mini-batches of forward,
backward and AdamW), plus ``balance`` where it is on, with its own engines on the same rows. Rounds run
every configuration in turn; the table gives medians over rounds of the slowest rank's phase times, the
largest rise of resident memory within a phase over its start (``spmdrl.metrics.PhaseTimer``), AdamW state
bytes, and the step time of the padded fixed-micro-batch baseline over each row's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from spmdrl.batch import Batch  # noqa: E402
from spmdrl.builtin.models import build_model  # noqa: E402
from spmdrl.engines.balance import balance_rows  # noqa: E402
from spmdrl.engines.fsdp2.engine import FSDP2Engine, resolve_attn_implementation  # noqa: E402
from spmdrl.engines.fsdp2.lora import LoraSpec  # noqa: E402
from spmdrl.metrics import PhaseTimer  # noqa: E402
from spmdrl.parallel import ParallelDims  # noqa: E402
from spmdrl.precision import resolve_dtype  # noqa: E402

# name -> (packed, token budget, balance, LoRA rank)
CONFIGS = {
    "padded, fixed micro": (False, False, False, 0),
    "packed, fixed micro": (True, False, False, 0),
    "padded, token budget": (False, True, False, 0),
    "packed, token budget": (True, True, False, 0),
    "packed, budget, balance": (True, True, True, 0),
    "packed, budget, balance, LoRA r16": (True, True, True, 16),
}
PHASES = ("balance", "old_logp", "ref", "update")


def rollout_rows(rank: int, groups: int, n: int, prompt: int, resp: int, vocab: int, full: bool,
                 workload: str = "long-tail") -> Batch:
    """This rank's rows: ``groups`` prompts x ``n`` responses, long-tailed lengths (or all full); the
    ``long-prompts`` workload has long-tailed prompts (mean a quarter of the longest) and responses of
    ``resp`` tokens, as a math set of 8-240-word questions with short answers."""
    g = torch.Generator().manual_seed(1000 + rank)
    rows = groups * n
    if full:
        p_len, r_len = torch.full((rows,), prompt), torch.full((rows,), resp)
    elif workload == "long-prompts":
        p_len = torch.empty(groups).exponential_(4.0 / prompt, generator=g).long().clamp(8, prompt)
        p_len, r_len = p_len.repeat_interleave(n), torch.full((rows,), resp)
    else:
        p_len = torch.empty(groups).exponential_(4.0 / prompt, generator=g).long().clamp(8, prompt)
        hard = torch.empty(groups).exponential_(4.0 / resp, generator=g)  # a prompt's typical answer
        r_len = (hard.repeat_interleave(n) * torch.empty(rows).uniform_(0.5, 1.5, generator=g)).long()
        p_len, r_len = p_len.repeat_interleave(n), r_len.clamp(8, resp)
    pos = torch.arange(prompt + resp)
    attn = ((pos >= prompt - p_len[:, None]) & (pos < prompt + r_len[:, None])).long()  # [N, P+R]
    return Batch(dict(
        input_ids=torch.randint(3, vocab, (rows, prompt + resp), generator=g) * attn,
        attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=attn[:, prompt:].float(), advantages=torch.randn(rows, resp, generator=g),
        index=torch.arange(groups).repeat_interleave(n) + rank * groups,
    ))


def pg_loss(outputs, mb, scale):
    loss = -(outputs["logp"] * mb["advantages"] * mb["response_mask"]).sum() / scale.global_tokens
    return loss, {}


def adam_bytes(engine: FSDP2Engine) -> int:
    """AdamW state of the whole model: exp_avg and exp_avg_sq of each trained value (a DTensor's numel is
    the full parameter's, over all shards)."""
    return 2 * sum(p.numel() * p.element_size() for p in engine.model.parameters() if p.requires_grad)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Setup:
    """One configuration's engines and how it runs a step's training phases."""

    def __init__(self, name: str, model: str, args, mesh, attn: str, dtype: torch.dtype) -> None:
        self.name = name
        self.packed, self.budget, self.balance, rank = CONFIGS[name]
        common = dict(dp_mesh=mesh, device="cpu", param_dtype=dtype, attn_implementation=attn,
                      remove_padding=self.packed, seed=0)
        self.actor = FSDP2Engine(model, role="actor", lr=1e-6,
                                 lora=LoraSpec(rank, 2 * rank) if rank else None, **common)
        self.ref = self.actor.base_reference() or FSDP2Engine(model, role="ref", **common)
        self.timer = PhaseTimer(torch.device("cpu"))
        self.args = args

    def step(self, batch: Batch, budget: int) -> dict[str, float]:
        a, t = self.args, self.timer
        kw = dict(max_token_len=budget) if self.budget else {}
        start: dict[str, float] = {}
        if self.balance:
            start["balance"] = rss_mb()
            with t.phase("balance"):
                batch, self.spread = balance_rows(batch, a.n, len(batch) // 2, dist.group.WORLD,
                                                  torch.device("cpu"))
        start["old_logp"] = rss_mb()
        with t.phase("old_logp"):
            self.actor.forward_no_grad(batch, a.micro, **kw)
        start["ref"] = rss_mb()
        with t.phase("ref"):
            self.ref.forward_no_grad(batch, a.micro, **kw)
        start["update"] = rss_mb()
        with t.phase("update"):
            self.actor.train_step(batch, pg_loss, len(batch) // 2, a.micro, **kw)
        m = t.pop()
        m["rise_mb"] = max(m[f"memory/{ph}_peak_gb"] * 1024 - mb for ph, mb in start.items())
        return m


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_rows(setups: list[Setup], batch: Batch, budget: int, rounds: int) -> dict[str, dict[str, list]]:
    """Per configuration: each phase's slowest-rank seconds and memory rise per round (round-robin)."""
    out: dict[str, dict[str, list]] = {s.name: {} for s in setups}
    for r in range(rounds + 1):  # round 0 warms up
        for s in setups:
            m = s.step(batch, budget)
            if r == 0:
                continue
            for ph in PHASES:
                key = f"timing/{ph}"
                out[s.name].setdefault(ph, []).append(slowest(m.get(key, 0.0)))
            out[s.name].setdefault("step", []).append(sum(out[s.name][ph][-1] for ph in PHASES))
            out[s.name].setdefault("rise", []).append(slowest(m["rise_mb"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--groups", type=int, default=8, help="prompts per rank")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="rows per fixed micro-batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--only", default="", help="row names to run, separated by | (default: all)")
    ap.add_argument("--workload", choices=["long-tail", "long-prompts"], default="long-tail",
                    help="long-tail: prompts and responses long-tailed; long-prompts: long-tailed prompts, "
                         "responses of --response tokens (e.g. --prompt 256 --response 32)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    folder = Path(tempfile.gettempdir()) / f"spmdrl_bench_{args.size}_{os.environ.get('MASTER_PORT', '0')}"
    if rank == 0 and not (folder / "config.json").exists():
        build_model(folder, args.size)
    dist.barrier()
    mesh = ParallelDims(dist.get_world_size()).build().fsdp_mesh
    dtype = resolve_dtype(args.dtype, "cpu")
    attn = resolve_attn_implementation("auto", "cpu", args.prompt + args.response)
    names = [n for n in CONFIGS if not args.only or n in args.only.split("|")]
    setups = [Setup(name, str(folder), args, mesh, attn, dtype) for name in names]
    full_adam = max(adam_bytes(s.actor) for s in setups)
    if rank == 0:
        print(f"{args.size} model, {dist.get_world_size()} ranks x {args.groups} prompts x {args.n} "
              f"responses, "
              f"<= {args.prompt} + {args.response} tokens, {dtype} compute, attention {attn}, "
              f"{torch.get_num_threads()} threads per rank; medians of {args.rounds} rounds; seconds are the "
              f"slowest rank's")
    for full in (False, True):
        batch = rollout_rows(rank, args.groups, args.n, args.prompt, args.response, 2048, full, args.workload)
        tokens = torch.tensor([float(batch["attention_mask"].sum())])
        dist.all_reduce(tokens)
        budget = args.micro * int(tokens) // (len(batch) * dist.get_world_size())  # micro x the mean row
        res = run_rows(setups, batch, budget, args.rounds)
        if rank != 0:
            continue
        share = float(batch["attention_mask"].float().mean())
        print(f"\nrows {'all full' if full else f'long-tailed: {share:.0%} of the padded tokens are real'}; "
              f"token budget {budget} per micro-batch\n")
        ratio = "x padded" if names[0] == next(iter(CONFIGS)) else "x first row"
        print("| configuration | s/step | update s | old_logp s | ref s | balance s | phase memory rise MB "
              f"| AdamW state MB | {ratio} |")
        print("|---|---|---|---|---|---|---|---|---|")
        base = statistics.median(res[names[0]]["step"])
        for s in setups:
            med = {k: statistics.median(v) for k, v in res[s.name].items()}
            adam = adam_bytes(s.actor) / 2**20
            print(f"| {s.name} | {med['step']:.3f} | {med['update']:.3f} | {med['old_logp']:.3f} | "
                  f"{med['ref']:.3f} | {med['balance']:.3f} | {med['rise']:.0f} | {adam:.1f} | "
                  f"{base / med['step']:.2f} |", flush=True)
        spread = next((s.spread for s in setups if s.balance), None)
        if spread:
            print(f"\nmost tokens on one rank over the mean: {spread['perf/balance_before']:.3f} as "
                  f"generated, {spread['perf/balance_after']:.3f} balanced")
        print(f"AdamW state of full fine-tuning: {full_adam / 2**20:.1f} MB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
