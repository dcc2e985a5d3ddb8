"""Colocated-sync against split-async on the same ranks, on long-tailed response lengths.

    python bench/async.py                          # 2 ranks: colocated on both, split 1 rollout + 1 train
    python bench/async.py --ranks 3 --rounds 3     # 3 ranks: colocated on 3, split 1 + 2
    python bench/async.py --staleness 1 2          # split at rollout.max_staleness 1 and 2

The workload is the one asynchronous rollout exists for: most responses stop early, a few run to the
maximum, so a synchronous step waits for its longest response while the other rows are done. It is built
from a randomly initialised ``builtin:tiny`` whose generation_config names ``--stop-ids`` frequent tokens as
end-of-sequence ids: each sampled token ends the response with a probability of about stop-ids /
vocabulary, so lengths are geometric and ``--max-response`` cuts the tail (the table gives the mean and the
share of responses cut). Both configurations run the main job's GRPO (packed rows, token budgets) for
``--steps`` steps through ``torchrun``, the same prompts and seed; rounds interleave the configurations and
the table gives medians over rounds of the per-step medians of steps 2 onwards (step 1 builds kernels):

- s/step, steps/s and tokens/s (prompt and response tokens trained per second, ``perf/tokens_per_s``);
- wait_rollout: the training ranks' wait for the batch (colocated: the rollout itself);
- idle: each role's share of a step spent waiting on the other (training: wait_rollout; rollout: the
  sends and the wait for weights);
- weights/update: the weight hand-over's time as a fraction of the update's (split: the training ranks'
  export and send, ``timing/weight_send``; colocated: the engine's load, ``timing/weight_sync``);
- reward: the mean reward of the last step (a random model: near the task's floor; it shows both learn
  alike, not how well).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout


def workload_model(folder: Path, stop_ids: int, seed: int) -> Path:
    """A random ``tiny`` model whose generation_config ends a response at any of ``stop_ids`` token ids (the
    most frequent ones after the specials in the built-in tokenizer's vocabulary)."""
    from spmdrl.builtin.models import build_model

    model = build_model(folder, "tiny", seed=seed)
    gen = json.loads((model / "generation_config.json").read_text())
    specials = set(gen["eos_token_id"]) | {gen.get("pad_token_id"), gen.get("bos_token_id")}
    ids = [i for i in range(stop_ids + len(specials)) if i not in specials][:stop_ids]
    gen["eos_token_id"] = sorted(set(gen["eos_token_id"]) | set(ids))
    (model / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return model


def run(name: str, argv: list[str], nproc: int, out: Path, cache: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "spmdrl.train", *argv, "--trainer.output_dir", str(out)]
    env = {**os.environ, "SPMDRL_CACHE": cache, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(rows: list[dict], split: bool) -> dict[str, float]:
    """Per-step medians of steps 2 onwards, and the last step's reward."""
    steps = [r for r in rows if r["step"] >= 2]

    def med(f) -> float:
        return statistics.median(f(r) for r in steps)

    out = {
        "s/step": med(lambda r: r["timing/step"]),
        "tokens/s": med(lambda r: r["perf/tokens_per_s"]),
        "wait_rollout": med(lambda r: r.get("timing/wait_rollout", r.get("timing/rollout", 0.0))),
        "train idle": med(lambda r: r.get("timing/wait_rollout", 0.0) / r["timing/step"]) if split else
        med(lambda r: (r["timing/rollout"] + r.get("timing/weight_sync", 0.0)) / r["timing/step"]),
        "rollout idle": med(lambda r: (r.get("rollout_ranks/timing/send_batch", 0.0)
                                       + r.get("rollout_ranks/timing/wait_weights", 0.0))
                            / r["rollout_ranks/timing/step"]) if split else
        med(lambda r: 1 - (r["timing/rollout"] + r.get("timing/weight_sync", 0.0)) / r["timing/step"]),
        "weights/update": med(lambda r: r.get("timing/weight_send" if split else "timing/weight_sync", 0.0)
                              / r["timing/update"]),
        "reward": rows[-1]["reward/mean"],
        "length": med(lambda r: r["response_length/mean"]),
        "cut": med(lambda r: r["response_length/clip_ratio"]),
    }
    out["steps/s"] = 1 / out["s/step"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rollout-ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="data.train_batch_size")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-response", type=int, default=192)
    p.add_argument("--stop-ids", type=int, default=20, help="token ids that end a response")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staleness", type=int, nargs="+", default=[1], help="split rows' rollout.max_staleness")
    args = p.parse_args()

    cache = os.environ.get("SPMDRL_CACHE") or str(Path.home() / ".cache" / "spmdrl")
    work = Path(tempfile.mkdtemp(prefix="spmdrl-async-"))
    model = workload_model(work / "model", args.stop_ids, args.seed)
    train = args.ranks - args.rollout_ranks
    common = ["--config", str(REPO / "configs/grpo.yaml"), "--model.path", str(model),
              "--trainer.total_steps", str(args.steps), "--trainer.val_before_train", "false",
              "--trainer.test_freq", "-1", "--trainer.progress_bar", "false", "--trainer.resume", "off",
              "--trainer.plot_freq", "-1", "--data.train_batch_size", str(args.prompts),
              "--actor.ppo_mini_batch_size", str(args.prompts), "--rollout.n", str(args.n),
              "--data.max_response_length", str(args.max_response), "--actor.param_dtype", args.dtype,
              "--rollout.dtype", args.dtype, "--model.use_remove_padding", "true",
              "--actor.use_dynamic_bsz", "true", "--ref.log_prob_use_dynamic_bsz", "true",
              "--trainer.seed", str(args.seed)]
    configs = {f"colocated sync, {args.ranks} ranks": (args.ranks, [])}
    for s in args.staleness:
        name = f"split async, {args.rollout_ranks} rollout + {train} train"
        name += f", staleness {s}" if s != 1 else ""
        configs[name] = (args.ranks, ["--rollout.placement", "split", "--rollout.n_gpus_per_node",
                                      str(args.rollout_ranks), "--rollout.max_staleness", str(s)])
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for i, (name, (nproc, extra)) in enumerate(configs.items()):
            rows = run(name, [*common, *extra], nproc, work / f"r{round_}c{i}", cache)
            results[name].append(summary(rows, split=bool(extra)))
            print(f"round {round_ + 1}/{args.rounds} {name}: {results[name][-1]['s/step']:.3f} s/step",
                  flush=True)
    base = statistics.median(r["s/step"] for r in results[next(iter(configs))])
    cols = ["s/step", "steps/s", "tokens/s", "wait_rollout", "train idle", "rollout idle", "weights/update",
            "length", "cut", "reward"]
    print(f"\n{args.prompts} prompts x {args.n}, responses up to {args.max_response} tokens "
          f"({args.stop_ids} stop ids), {args.steps} steps, medians of steps 2-{args.steps} over "
          f"{args.rounds} interleaved rounds\n")
    print("| configuration | " + " | ".join(cols) + " | x colocated |")
    print("|---" * (len(cols) + 2) + "|")
    for name, runs in results.items():
        med = {c: statistics.median(r[c] for r in runs) for c in cols}
        cells = [f"{med[c]:.3f}" if c not in ("tokens/s",) else f"{med[c]:,.0f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + f" | {base / med['s/step']:.2f} |")


if __name__ == "__main__":
    main()
