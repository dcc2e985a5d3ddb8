"""Learning table: every shipped algorithm's config trained on the built-in task, one row each.

    python bench/learning.py                                   # the nine configs, 2 ranks, seed 1
    python bench/learning.py --configs grpo ppo --seeds 1 2 3 --steps 100 --out /tmp/learning
    python bench/learning.py --extra --actor.param_dtype float32 --rollout.dtype float32
    python bench/learning.py --configs grpo --seeds 1 2 3 4 5  # the main job's seed sweep: a row per seed
    python bench/learning.py --configs grpo_moe --seeds 1 2 3 [--extra --actor.router_replay disabled]

Each config runs as the README's main job does (``torchrun --standalone --nproc-per-node N -m
spmdrl.train --config configs/NAME.yaml``) from the config's own model path, so every row starts from
the same warm start when the configs share one. Per run, from its ``metrics.jsonl`` (``reward/mean``,
the training batch's mean reward, sampled at the config's temperature):

- start / end: mean reward of the first and of the last 10 steps; best: the best 10-step window;
- to 0.5: the first step at which the 10-step mean reaches 0.5 ("-" if never);
- entropy: the actor's token entropy at the first step and its minimum;
- collapsed: yes when the last 10 steps fall below 0.9 x the best window, or the entropy falls below
  ``--entropy-floor`` x its first-step value (a policy pinned to one answer), the two failure shapes the main
  job used to show. Relative, because ``actor/entropy`` is aggregated with the config's ``loss_agg_mode``:
  Dr. GRPO's constant-length normalisation reports 1/8 of the token mean on 2-token answers;
- wall: seconds of the whole command (model and data are cached after the first run).

Runs are sequential (each uses every core); with several seeds each row is the median over seeds. One
figure of all reward curves is written with ``spmdrl.plot`` to ``OUT/compare/reward.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("grpo", "dapo", "drgrpo", "ppo", "rloo", "reinforce_pp", "remax", "gspo", "gpg")
WINDOW = 10


def run_config(name: str, seed: int, out: Path, nproc: int, steps: int | None, extra: list[str]) -> float:
    """Train one config; returns the command's wall time in seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "spmdrl.train", "--config", str(REPO / "configs" / f"{name}.yaml"),
           "--trainer.output_dir", str(out), "--trainer.seed", str(seed), "--trainer.progress_bar", "false",
           "--trainer.resume", "off", *(["--trainer.total_steps", str(steps)] if steps else []), *extra]
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"{name} (seed {seed}) failed with exit code {proc.returncode}; see {out}.log")
    return time.perf_counter() - start


def summarise(run_dir: Path, entropy_floor: float) -> dict[str, float]:
    """The row's numbers from one run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    entropy = [r["actor/entropy"] for r in rows if "actor/entropy" in r]
    windows = [statistics.fmean(rewards[i:i + WINDOW]) for i in range(len(rewards) - WINDOW + 1)]
    reached = next((i + WINDOW for i, w in enumerate(windows) if w >= 0.5), None)
    best, last = max(windows), windows[-1]
    return {
        "start": windows[0], "end": last, "best": best, "to_half": reached,
        "entropy0": entropy[0] if entropy else float("nan"),
        "entropy_min": min(entropy) if entropy else float("nan"),
        "collapsed": last < 0.9 * best or (bool(entropy) and min(entropy) < entropy_floor * entropy[0]),
    }


def _median_row(rows: list[dict]) -> dict:
    keys = ("start", "end", "best", "entropy0", "entropy_min", "wall")
    out = {k: statistics.median(r[k] for r in rows) for k in keys}
    reached = [r["to_half"] for r in rows if r["to_half"] is not None]
    out["to_half"] = statistics.median(reached) if len(reached) == len(rows) else None
    out["collapsed"] = sum(r["collapsed"] for r in rows)
    return out


def print_table(results: dict[str, list[dict]], seeds: list[int]) -> None:
    print(f"\nload average {os.getloadavg()[0]:.1f}; seeds {seeds}; median over seeds; collapsed: runs of "
          f"{len(seeds)}")
    print("| config | reward start | end | best 10 | end - start | steps to 0.5 | entropy start -> min "
          "| collapsed | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        m = _median_row(rows)
        half = "-" if m["to_half"] is None else f"{m['to_half']:.0f}"
        gain = m["end"] - m["start"]
        print(f"| {name} | {m['start']:.3f} | {m['end']:.3f} | {m['best']:.3f} | {gain:+.3f} | {half} "
              f"| {m['entropy0']:.2f} -> {m['entropy_min']:.2f} | {m['collapsed']} | {m['wall']:.0f} |")


def learns(row: dict, floor: float = 0.6, gain: float = 0.25) -> bool:
    """The main job's promise for one seed: the last 10 steps at ``floor`` or more, ``gain`` above the first
    10, and no collapse."""
    return row["end"] >= floor and row["end"] >= row["start"] + gain and not row["collapsed"]


def print_seeds(results: dict[str, list[dict]], seeds: list[int]) -> None:
    """One row per config and seed, with whether that seed learns (``learns``)."""
    print("\n| config | seed | reward first 10 -> best 10 -> last 10 | gain | lowest entropy | collapsed "
          "| learns (last 10 >= 0.6, gain >= 0.25) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for seed, r in zip(seeds, rows):
            print(f"| {name} | {seed} | {r['start']:.2f} -> {r['best']:.2f} -> {r['end']:.2f} "
                  f"| {r['end'] - r['start']:+.2f} | {r['entropy_min']:.2f} "
                  f"| {'yes' if r['collapsed'] else 'no'} "
                  f"| {'yes' if learns(r) else 'NO'} | {r['wall']:.0f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Any shipped RL config may be named (grpo_moe: the MoE main job); the default is the nine algorithms.
    shipped = sorted(c.stem for c in (REPO / "configs").glob("*.yaml") if c.stem != "sft")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=shipped)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--entropy-floor", type=float, default=0.05,
                   help="collapsed below this x the first entropy")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_learning"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer arguments, last")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for name in args.configs:
        for seed in args.seeds:
            run_dir = args.out / f"{name}_seed{seed}"
            wall = run_config(name, seed, run_dir, args.nproc, args.steps, args.extra)
            row = {**summarise(run_dir, args.entropy_floor), "wall": wall}
            results.setdefault(name, []).append(row)
            print(f"{name} seed {seed}: {json.dumps(row)}", flush=True)
    print_table(results, args.seeds)
    if len(args.seeds) > 1:  # the seed sweep: the main job learns at every seed (README)
        print_seeds(results, args.seeds)
    from spmdrl.plot import plot_runs

    runs = [args.out / f"{name}_seed{args.seeds[0]}" for name in args.configs]
    for path in plot_runs(runs, args.out / "compare"):
        print(f"figure: {path}")


if __name__ == "__main__":
    main()
