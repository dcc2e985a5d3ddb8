"""GRPO through the loop with a library rollout engine (vLLM, SGLang) on 2 torchrun ranks: the loop's metrics,
the rollout log-probs equal to the actor's after every weight sync, and the memory plan's peak of every phase
within 15% of the one measured (trainer.exact_memory; SGLang's scheduler processes are outside both). Each
engine's test module (run in its own venv) calls ``check_grpo_through_loop``."""

from __future__ import annotations

import json
from pathlib import Path

from torchrun import torchrun

# The tolerance of the native engine's round trip (tests/multiproc/test_weight_sync.py), fp32 both sides.
LOGP_TOL = 1e-4


def check_grpo_through_loop(engine: str, tp: int, out_dir: Path, split: bool = False) -> None:
    """``split``: rollout.placement split, ``tp`` rollout ranks (one TP group) + 1 training rank, staleness 0
    (each batch generated with the weights the training rank sent after the previous update, so the gap to
    the actor is a transfer's)."""
    # ppo_mini_batch_size 4 of 8 prompts: two optimizer steps, so the actor recomputes old log-probs and the
    # loop reports training/rollout_logp_diff (the rollout against the actor, after the step's weight sync).
    args = ["--config", "configs/grpo.yaml", "--rollout.engine", engine, "--trainer.total_steps", "3",
            "--data.train_batch_size", "8", "--actor.ppo_mini_batch_size", "4", "--actor.ppo_epochs", "1",
            "--trainer.progress_bar",
            "false", "--trainer.resume", "off",
            # float32 on both sides whatever auto picks on this CPU (the tolerance below is a float32 one)
            "--rollout.dtype", "float32", "--actor.param_dtype", "float32",
            # eager RMSNorm/SwiGLU: the compiled ones cost ~3 s a rank to trace and load, and are no part of
            # what this checks (tests/unit/test_fused.py holds them to eager)
            "--model.fused_kernels", "off",
            # each phase's own RSS peak, to hold the plan against; the longest arith prompt
            "--trainer.exact_memory", "true", "--data.max_prompt_length", "27"]
    if split:  # one rollout TP group (tp ranks) and one training rank
        args += ["--rollout.placement", "split", "--rollout.n_gpus_per_node", str(tp),
                 "--rollout.max_staleness", "0"]
    ranks = tp + 1 if split else 2
    torchrun(["-m", "spmdrl.train", *args, "--parallel.rollout_tp", str(tp), "--trainer.output_dir",
              str(out_dir)], nproc=ranks)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # 8 prompts x 8 responses: a count is the batch's, summed over the ranks that hold it, whatever the
        # rollout TP (split: the rollout ranks count them, each keeping its 1/tp share of its TP group's 64).
        assert r["batch/responses"] == 64
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["response_length/mean"] > 0
        assert r["training/rollout_logp_diff/max"] < LOGP_TOL, r
    # Step 1 generates from the folder's weights; later steps sync the trained ones in first.
    sync = "rollout_ranks/timing/weight_sync" if split else "timing/weight_sync"
    assert all(r[sync] > 1e-3 for r in rows[1:])
    assert rows[-1]["actor/pg_loss"] == rows[-1]["actor/pg_loss"]  # finite
    if split:  # a split run's plans are held to measured peaks with the native engine (test_memory_plan.py)
        return
    planned = json.loads((out_dir / "plan.json").read_text())["peak_gb"]
    off = {p: (round(gb, 3), round(rows[-1][f"memory/{p}_peak_gb"], 3)) for p, gb in planned.items()
           if abs(gb - rows[-1][f"memory/{p}_peak_gb"]) > 0.15 * rows[-1][f"memory/{p}_peak_gb"]}
    assert not off, f"planned vs measured GB outside 15%: {off}"
