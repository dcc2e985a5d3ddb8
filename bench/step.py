"""Seconds per GRPO step and tokens/s: spmdrl at world size 1 and 2, colocated sleep/wake on and off, vs TRL.

    python bench/step.py                       # tiny model, 8 prompts x 8 responses x 64 new tokens
    python bench/step.py --model small --steps 5
    python bench/step.py --vllm-python .venv-vllm/bin/python  # adds rollout.engine vllm at rollout TP 1 and 2
    python bench/step.py --sglang-python .venv-sglang/bin/python  # adds rollout.engine sglang at TP 1 and 2
    python bench/step.py --megatron --no-trl   # instead: 2-rank fp32 rows of fsdp2 and megatron
                                               # (tp 1, tp 2, pp 2)
    python bench/step.py --model tiny-moe      # instead: the MoE model against its dense twin of the same
                                               # active parameters (builtin:tiny-moe-dense), 2 ranks

Every spmdrl row is a real ``python -m spmdrl.train`` (torchrun for 2 ranks)
run of configs/grpo.yaml at the same global batch; the figure is the median
over its steps after the first (warm-up), pooled over ``--rounds`` rounds that
run every configuration in turn. TRL's GRPOTrainer (``pip install
trl``; skipped when absent) runs the same model, task and sizes in the same
invocation, so the ratio column compares like with like on this machine.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "auto": "auto"}
# Training engine of a row -> its command-line arguments.
TRAIN_ENGINES = {
    "fsdp2": [],
    "megatron tp=1": ["--actor.strategy", "megatron"],
    "megatron tp=2": ["--actor.strategy", "megatron", "--parallel.tp", "2"],
    "megatron pp=2": ["--actor.strategy", "megatron", "--parallel.pp", "2"],
}
sys.path.insert(0, str(REPO))  # runnable from a checkout without pip install


def spmdrl_run(model: str, run: tuple, a: argparse.Namespace, tmp: Path) -> list[dict]:
    """The metrics.jsonl rows of one training run (world, colocate, dtype, engine, rollout TP, training
    engine), warm-up step dropped; vllm runs use ``--vllm-python``, sglang runs ``--sglang-python``."""
    world, colocate, dtype, engine, tp, train = run
    out = tmp / f"w{world}_c{int(colocate)}_{dtype}_{engine}{tp}_{train}"
    shutil.rmtree(out, ignore_errors=True)
    args = [
        "--config", "configs/grpo.yaml", "--model.path", f"builtin:{model}",
        "--trainer.total_steps", str(a.steps),
        "--data.train_batch_size", str(a.prompts), "--actor.ppo_mini_batch_size", str(a.prompts),
        "--rollout.n", str(a.n), "--data.max_response_length", str(a.new_tokens),
        "--actor.ppo_micro_batch_size_per_gpu", str(a.prompts * a.n), "--actor.use_kl_loss", "true",
        "--trainer.sleep_rollout", str(colocate).lower(), "--trainer.progress_bar", "false",
        "--trainer.resume", "off",
        "--trainer.logger", "[jsonl]", "--trainer.output_dir", str(out),
        "--rollout.dtype", DTYPES[dtype], "--actor.param_dtype", DTYPES[dtype],
        "--rollout.ignore_eos", "true",  # every response is new_tokens long, in TRL's run too: equal work
        "--rollout.engine", engine, "--parallel.rollout_tp", str(tp), *TRAIN_ENGINES[train],
    ]
    python = {"vllm": a.vllm_python, "sglang": a.sglang_python}.get(engine) or sys.executable
    if world == 1:
        cmd = [python, "-m", "spmdrl.train", *args]
    else:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "spmdrl.train", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(max(1, a.threads // world))}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"spmdrl run failed ({run}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in open(out / "metrics.jsonl")][1:]


def summarize(rows: list[dict]) -> dict:
    """Medians over every measured step of every round; peaks are maxima."""
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "step_s": med("timing/step"), "rollout_s": med("timing/rollout"), "update_s": med("timing/update"),
        "sync_s": med("timing/weight_sync"),
        # offload: the optimizer state's moves around rollout (the memory plan's decision; none on CPU)
        "offload_s": statistics.median(r.get("timing/offload", 0.0) + r.get("timing/onload", 0.0)
                                       for r in rows),
        "other_s": med("timing/other"),
        "length": med("response_length/mean"),
        "peak_gb": max(r["memory/overall_peak_gb"] for r in rows),
        "max_phase_gb": max(max(v for k, v in r.items() if k.endswith("_peak_gb") and "overall" not in k
                                and "rank" not in k) for r in rows),
    }


def trl_run(model_dir: str, data: str, dtype: str, a: argparse.Namespace,
            tmp: Path) -> dict[str, list[float]]:
    """Seconds and mean completion length of every optimizer step of one TRL run, warm-up step dropped."""
    cmd = [sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--model", model_dir, "--data", data,
           "--steps", str(a.steps), "--prompts", str(a.prompts), "--n", str(a.n),
           "--new-tokens", str(a.new_tokens),
           "--out", str(tmp / f"trl_{dtype}")] + (["--bf16"] if dtype == "bf16" else [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
    out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"step_s": result["step_s"][1:], "length": result["mean_length"][1:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "tiny-moe"])
    p.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="CPU threads per run, split over ranks")
    p.add_argument("--rounds", type=int, default=2, help="times every runner runs, interleaved")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm (.venv-vllm/bin/python): adds 2-rank rows with "
                        "rollout.engine vllm")
    p.add_argument("--sglang-python", default=None,
                   help="python of .venv-sglang (.ci/sglang-venv): adds 2-rank rows with rollout.engine "
                        "sglang (its engines' memory is in their scheduler processes, not in the peak GB)")
    p.add_argument("--megatron", action="store_true",
                   help="instead of the main rows: 2-rank colocated fp32 rows of actor.strategy fsdp2 and "
                        "megatron (tp 1, tp 2, pp 2)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="compute and rollout dtype of the main rows (auto: bf16 where native, else fp32)")
    a = p.parse_args()

    import torch

    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.builtin.tasks import resolve_builtin_data

    model_dir = resolve_builtin_model(f"builtin:{a.model}")
    data = resolve_builtin_data("builtin:arith", "train")
    # spmdrl's precision (by default what auto picks here: bf16 compute with float32 master weights where
    # bf16 is native, else fp32) in every layout, and float32 compute on one rank: the like-for-like row
    # against TRL's float32 reference figure.
    main_dtype = a.dtype
    if a.dtype == "auto":
        from spmdrl.precision import resolve_dtype

        main_dtype = "bf16" if resolve_dtype("auto", "cpu") == torch.bfloat16 else "fp32"
    runs = [(1, True, main_dtype, "native", 1, "fsdp2"), (1, False, main_dtype, "native", 1, "fsdp2"),
            (2, True, main_dtype, "native", 1, "fsdp2"), (2, False, main_dtype, "native", 1, "fsdp2")]
    runs += [(1, True, "fp32", "native", 1, "fsdp2")] if main_dtype != "fp32" else []
    # the same 2-rank colocated work, rolled out by vLLM: one engine per rank, then one over both
    if a.vllm_python:
        runs += [(2, True, main_dtype, "vllm", 1, "fsdp2"), (2, True, main_dtype, "vllm", 2, "fsdp2")]
    if a.sglang_python:  # one SGLang engine per rank (its scheduler in a child process), then one of TP 2
        runs += [(2, True, main_dtype, "sglang", 1, "fsdp2"), (2, True, main_dtype, "sglang", 2, "fsdp2")]
    if a.megatron:  # the Megatron engine computes in float32: against FSDP2 in float32 on the same work
        runs = [(2, True, "fp32", "native", 1, t) for t in TRAIN_ENGINES]
    if a.model == "tiny-moe":
        return moe_vs_dense(a, main_dtype)
    trl_dtypes = ("fp32", main_dtype) if not a.no_trl and importlib.util.find_spec("trl") else ()
    trl_dtypes = tuple(dict.fromkeys(trl_dtypes))
    trl_steps: dict[str, dict[str, list[float]]] = {d: {"step_s": [], "length": []} for d in trl_dtypes}
    spmdrl_steps: dict[tuple, list[dict]] = {r: [] for r in runs}
    # Rounds interleave every runner, so a slow spell of a shared machine lands on all of them.
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for _ in range(a.rounds):
            for d in trl_dtypes:
                for k, v in trl_run(model_dir, data, d, a, tmp).items():
                    trl_steps[d][k] += v
            for run in runs:
                spmdrl_steps[run] += spmdrl_run(a.model, run, a, tmp)
    trl = {d: {k: statistics.median(v) if v else float("nan") for k, v in r.items()}
           for d, r in trl_steps.items()}
    rows = [(run, summarize(spmdrl_steps[run])) for run in runs]
    tokens = a.prompts * a.n * a.new_tokens
    base = trl.get("fp32")
    print(f"\nGRPO step, {a.model} model, {a.prompts} prompts x {a.n} responses x {a.new_tokens} new tokens, "
          f"KL to reference, one PPO epoch, {a.threads} CPU threads; medians of {a.rounds} x {a.steps - 1} "
          f"steps after warm-up (rounds interleaved). "
          f"bf16 = bf16 compute with float32 master weights (TRL: bf16=True autocast; spmdrl: FSDP2 "
          f"param_dtype and rollout dtype). 'vs TRL' divides TRL fp32's s/step by the row's.\n")
    print("| runner | training | rollout | precision | ranks | sleep/wake | resp len | s/step | gen tok/s "
          "| rollout s | sync s | update s | offload s | other s | peak GB | max phase GB | vs TRL fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, r in trl.items():
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        print(f"| TRL GRPOTrainer | transformers | transformers | {d} | 1 | - | {r['length']:.1f} | "
              f"{r['step_s']:.2f} | {tokens / r['step_s']:.0f} | | | | | | | | {ratio} |")
    for (world, colocate, d, engine, tp, train), r in rows:
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        print(f"| spmdrl | {train} | {engine} tp={tp} | {d} | {world} | {'on' if colocate else 'off'} | "
              f"{r['length']:.1f} | {r['step_s']:.2f} | {tokens / r['step_s']:.0f} | {r['rollout_s']:.2f} | "
              f"{r['sync_s']:.3f} | {r['update_s']:.2f} | {r['offload_s']:.3f} | {r['other_s']:.3f} | "
              f"{r['peak_gb']:.2f} | {r['max_phase_gb']:.2f} | {ratio} |")


def moe_vs_dense(a: argparse.Namespace, dtype: str) -> None:
    """builtin:tiny-moe against builtin:tiny-moe-dense (the same attention, an MLP as wide as a token's 2
    experts) on the same work, 2 ranks colocated, interleaved rounds: seconds per step and per phase, and the
    MoE model's ratio to the dense one in each."""
    run = (2, True, dtype, "native", 1, "fsdp2")
    steps: dict[str, list[dict]] = {"tiny-moe": [], "tiny-moe-dense": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for model in steps:
                steps[model] += spmdrl_run(model, run, a, Path(tmp) / model)
    phases = ("step", "rollout", "old_logp", "ref", "update", "weight_sync")
    med = {m: {k: statistics.median(r[f"timing/{k}"] for r in rows) for k in phases}
           for m, rows in steps.items()}
    print(f"\nGRPO step, MoE vs dense of the same active parameters, {a.prompts} prompts x {a.n} responses x "
          f"{a.new_tokens} new tokens, 2 ranks, {dtype}; medians of {a.rounds} x {a.steps - 1} steps after "
          f"warm-up (rounds interleaved), seconds\n")
    print("| model | " + " | ".join(phases) + " |")
    print("|---|" + "---|" * len(phases))
    for m, r in med.items():
        print(f"| {m} | " + " | ".join(f"{r[k]:.3f}" for k in phases) + " |")
    print("| MoE / dense | " + " | ".join(f"{med['tiny-moe'][k] / med['tiny-moe-dense'][k]:.2f}x"
                                         for k in phases) + " |")


if __name__ == "__main__":
    main()
