"""How far the trainer's log-probs are from the rollout's for an MoE model, with and without routing replay.

    python bench/moe_replay.py                      # configs/grpo_moe.yaml, 2 ranks, auto precision
    python bench/moe_replay.py --steps 20 --extra --actor.param_dtype float32 --rollout.dtype float32

Runs ``configs/grpo_moe.yaml`` (builtin:tiny-moe-arith, the native engine) once per
``actor.router_replay`` mode, the same seed, and prints the median over the steps of the rollout-vs-training
gap metrics the loop logs: the old-log-prob pass against the rollout's log-probs (``training/rollout_*``,
verl's rollout_actor gap) and the rollout-correction diagnostics (``rollout_corr/*``), with the router's
agreement with the routing the update replays. In bf16 the native engine and the trainer compute the
hidden states with different kernels, so a token near a tie between two experts can be routed differently;
R3 replays the rollout's choice in the old-log-prob pass, R2 replays the old-log-prob pass's in the update.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("disabled", "R2", "R3")
KEYS = ("training/rollout_logp_diff/max", "training/rollout_probs_diff/mean", "rollout_corr/kl",
        "rollout_corr/log_ppl_abs_diff", "actor/moe/old_logp_router_agreement", "actor/moe/router_agreement")


def run(mode: str, a: argparse.Namespace) -> list[dict]:
    out = a.out / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           "-m", "spmdrl.train", "--config", "configs/grpo_moe.yaml", "--actor.router_replay", mode,
           "--trainer.total_steps", str(a.steps), "--trainer.output_dir", str(out), "--trainer.resume", "off",
           "--trainer.progress_bar", "false", "--trainer.test_freq", "-1", "--trainer.val_before_train",
           "false", "--trainer.seed", str(a.seed), *a.extra]
    with open(a.out / f"{mode}.log", "w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"router_replay {mode} failed with exit code {done.returncode}; see {out}.log")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("outputs/bench_moe_replay"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer arguments, last")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = {mode: run(mode, a) for mode in MODES}
    print(f"\nconfigs/grpo_moe.yaml, {a.steps} steps, seed {a.seed}, {a.nproc} ranks {' '.join(a.extra)}: "
          f"medians over the steps\n")
    print("| router_replay | " + " | ".join(KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for mode, steps in rows.items():
        cells = []
        for key in KEYS:
            values = [r[key] for r in steps if key in r]
            cells.append(f"{statistics.median(values):.2e}" if values else "-")
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
