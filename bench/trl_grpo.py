"""TRL's GRPOTrainer on the same model, task and sizes as bench/step.py: the peer we measure against.

    python bench/trl_grpo.py --model DIR --data PARQUET --steps 6 --prompts 8 --n 8 --new-tokens 64

Prints one JSON line {"step_s": [...], "mean_length": [...]} with the wall time
of every optimizer step (generation + reward + reference + update), measured by
a callback, and TRL's logged mean completion length (64 every step: completions
are forced to full length, like spmdrl's ``rollout.ignore_eos``).
CPU, one process, fp32 (or --bf16), transformers generate (no vLLM), one PPO epoch, KL to
a reference (beta > 0), like spmdrl's configs/grpo.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="train parquet in verl's layout (spmdrl.builtin.tasks)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="/tmp/trl_bench")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16=True (autocast) instead of float32")
    a = p.parse_args()

    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from spmdrl.reward.scorers import compute_score

    ds = datasets.load_dataset("parquet", data_files=a.data, split="train")
    ds = ds.map(lambda row: {"prompt": list(row["prompt"]),
                             "ground_truth": row["reward_model"]["ground_truth"]},
                remove_columns=[c for c in ds.column_names if c not in ("prompt", "data_source")])

    def reward(completions, ground_truth, data_source, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [compute_score(s, t, g) for s, t, g in zip(data_source, texts, ground_truth)]
        return [float(o["score"] if isinstance(o, dict) else o) for o in out]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.lengths: list[float] = []
            self.t = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    clock = Clock()
    cfg = GRPOConfig(
        output_dir=a.out, per_device_train_batch_size=a.prompts * a.n, num_generations=a.n,
        max_completion_length=a.new_tokens, max_steps=a.steps, beta=0.001, num_iterations=1,
        learning_rate=1e-3, use_cpu=True, bf16=a.bf16, logging_steps=1, report_to="none", save_strategy="no",
        temperature=1.0,
        gradient_accumulation_steps=1, disable_dropout=True, seed=1,
        # Every completion runs to max_completion_length, as spmdrl's rollout.ignore_eos does: equal work.
        generation_kwargs={"min_new_tokens": a.new_tokens},
    )
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[clock])
    trainer.train()
    print(json.dumps({"step_s": clock.times, "mean_length": clock.lengths}))


if __name__ == "__main__":
    main()
