"""TRL's GRPOTrainer on the same model, data and sizes as a spmdrl GRPO run: the peer we measure against.

    python bench/trl_grpo.py --model DIR --data PARQUET --steps 6 --prompts 8 --n 8 --new-tokens 64
    python bench/trl_grpo.py --model DIR --data PARQUET --vllm --bf16 --prompts 16 --n 8 --new-tokens 256
                                                    # on a GPU: bench/gpu/matrix.py's trl-vllm cell

One step, as spmdrl counts them, is one generation of ``--prompts`` x ``--n`` completions and the
``--prompts / --mini`` optimizer steps that train on it (one PPO epoch: ``num_iterations=1``), in
micro-batches of ``--micro`` completions; spmdrl's data.train_batch_size, rollout.n,
actor.ppo_mini_batch_size and actor.ppo_micro_batch_size_per_gpu. As configs/grpo.yaml: temperature 1,
clip 0.2, token-mean loss (TRL's ``dapo``), KL to a reference model in the loss (``--beta``, k3 as spmdrl's
low_var_kl), lr 1e-4. Completions are exactly ``--new-tokens`` long (spmdrl's ``rollout.ignore_eos``;
``--no-ignore-eos`` lets them stop): vLLM's ``ignore_eos``, transformers' ``min_new_tokens``.

Device: CUDA when there is one (accelerate picks it; ``--device cpu`` keeps to the CPU), else CPU. ``--bf16``:
TRL's ``bf16=True``, autocast over float32 weights (spmdrl: actor.param_dtype bfloat16 over model.dtype
float32). No activation checkpointing (TRL's default has it; spmdrl's ``auto`` only where the update would
not fit). ``--vllm``: vLLM in ``colocate`` mode (in this process, on the training GPU; CUDA graphs, vLLM's
default) with sleep mode (TRL's level 2: weights and KV cache released for the update, the trainer's weights
loaded again before each generation; ``--no-vllm-sleep`` keeps them) and TRL's importance-sampling
correction off (spmdrl by default corrects nothing, and with one optimizer step per generation runs no old
log-prob forward; neither does TRL then). Without ``--vllm``: transformers' generate on the trained model.

Prints one JSON line of lists, one entry per step:

- ``step_s``: wall time of the step, from its first optimizer step's begin to its last one's end (CUDA
  synchronised there); the batch fetch before each optimizer step and the Trainer's logging after it are
  outside (milliseconds);
- ``tokens``: prompt + completion tokens of the step's generation (TRL's token ids, no padding);
  ``response_length``: their mean completion length;
- ``phase_s``: TRL's own timers (``profiling/Time taken: GRPOTrainer.<name>``, which TRL sends only to
  wandb, MLflow or trackio; read here by wrapping its ``ProfilingContext``) summed over the step, by
  spmdrl's phase names. ``rollout``: ``vLLM.generate`` or ``transformers.generate``, the generate call alone;
  ``weight_sync``: ``sync_weights`` (waking vLLM's weights and loading the trainer's; vLLM only); ``reward``:
  ``_calculate_rewards``; ``old_logp`` and ``ref``: ``_get_per_token_logps_and_entropies`` inside
  ``_prepare_inputs`` (old log-probs first, when TRL needs them: ``--mini`` below ``--prompts``; the reference
  model's last); ``update``: the step less ``_prepare_inputs``, so the loss's forward and backward, the
  optimizer step and what the Trainer does between them (gradient clipping, the scheduler; approximate in that
  sense); ``other``: ``_prepare_inputs`` less the phases above (tokenizing, decoding, waking vLLM's KV cache
  and putting it back to sleep, advantages, metrics). A phase TRL did not run is left out; the phases add
  up to ``step_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="train parquet in verl's layout (spmdrl.builtin.tasks)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--mini", type=int, default=None,
                   help="prompts per optimizer step (actor.ppo_mini_batch_size; default --prompts)")
    p.add_argument("--micro", type=int, default=None,
                   help="completions per forward/backward (actor.ppo_micro_batch_size_per_gpu; default all "
                        "of an optimizer step's)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every completion exactly --new-tokens long")
    p.add_argument("--beta", type=float, default=0.02, help="KL coefficient (actor.kl_loss_coef)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: CUDA when there is one")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16=True (autocast) instead of float32")
    p.add_argument("--vllm", action="store_true", help="vLLM (colocate) instead of transformers' generate")
    p.add_argument("--vllm-sleep", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's sleep mode (level 2) for the update")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3,
                   help="share of the GPU vLLM may take while awake (TRL's default)")
    p.add_argument("--max-prompt-length", type=int, default=64,
                   help="vLLM's max_model_len is this + --new-tokens (data.max_prompt_length)")
    p.add_argument("--out", default="/tmp/trl_bench")
    return p.parse_args()


def phases(timers: list[tuple[str, float, float]], step_s: float, beta: float) -> dict[str, float]:
    """spmdrl's phase names from TRL's timers of one step, (name, start, seconds) each; they add up to
    ``step_s``."""
    def total(*names: str) -> float:
        return sum((s for n, _, s in timers if n in names), 0.0)

    prepare = [(t0, t0 + s) for n, t0, s in timers if n == "_prepare_inputs"]
    logps = [s for n, t0, s in timers if n == "_get_per_token_logps_and_entropies"
             and any(a <= t0 <= b for a, b in prepare)]
    ref = logps[-1:] if beta else []  # TRL computes the old log-probs first, the reference's last
    ran = {n for n, _, _ in timers}
    out = {"rollout": total("vLLM.generate", "transformers.generate"),
           **({"weight_sync": total("sync_weights")} if "sync_weights" in ran else {}),
           "reward": total("_calculate_rewards"),
           **({"old_logp": sum(logps) - sum(ref)} if len(logps) > len(ref) else {}),
           **({"ref": sum(ref)} if ref else {}), "update": step_s - total("_prepare_inputs")}
    out["other"] = step_s - sum(out.values())
    return out


def main() -> None:
    a = parse_args()
    mini = a.mini or a.prompts
    micro = min(a.micro or mini * a.n, mini * a.n)
    if a.prompts % mini or (mini * a.n) % micro:
        raise SystemExit(f"--mini {mini} must divide --prompts {a.prompts}, and --micro {micro} the "
                         f"{mini * a.n} completions of an optimizer step")

    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

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
        """Per step (``per_step`` optimizer steps): wall time, TRL's timers, tokens and completion lengths."""

        def __init__(self, per_step: int) -> None:
            self.per_step, self.begin = per_step, 0.0
            self.steps: list[dict[str, Any]] = []

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % self.per_step == 0:
                self.steps.append({"wall": 0.0, "timers": [], "tokens": 0, "lengths": []})
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if args.device.type == "cuda":
                torch.cuda.synchronize()
            self.steps[-1]["wall"] += time.perf_counter() - self.begin

    clock = Clock(a.prompts // mini)
    log_metrics = profiling.ProfilingContext._log_metrics

    def timed(self, duration: float) -> None:  # TRL calls it on leaving each timer
        if clock.steps:  # "GRPOTrainer.vLLM.generate" -> "vLLM.generate", whatever the trainer class
            clock.steps[-1]["timers"].append((self.name.split(".", 1)[-1], self._start_time, duration))
        log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = timed

    class Measured(GRPOTrainer):
        def _generate(self, prompts):
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            clock.steps[-1]["tokens"] += sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
            clock.steps[-1]["lengths"] += [len(c) for c in completion_ids]
            return out

    if not a.ignore_eos:
        forced = None
    elif a.vllm:
        forced = {"ignore_eos": True}  # SamplingParams: max_tokens is --new-tokens
    else:
        forced = {"min_new_tokens": a.new_tokens}
    optimizer_steps = (mini * a.n) // micro
    cfg = GRPOConfig(
        output_dir=a.out, per_device_train_batch_size=micro, gradient_accumulation_steps=optimizer_steps,
        steps_per_generation=a.prompts * a.n // micro, num_generations=a.n,
        max_completion_length=a.new_tokens, max_steps=a.steps * (a.prompts // mini), beta=a.beta,
        num_iterations=1, learning_rate=a.lr, bf16=a.bf16,
        use_cpu=a.device == "cpu" or not torch.cuda.is_available(),
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no", temperature=1.0,
        lr_scheduler_type="constant", disable_dropout=True, seed=1, generation_kwargs=forced,
        use_vllm=a.vllm, vllm_mode="colocate", vllm_enable_sleep_mode=a.vllm and a.vllm_sleep,
        vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
        vllm_max_model_length=a.max_prompt_length + a.new_tokens, vllm_importance_sampling_correction=False,
    )
    trainer = Measured(model=a.model, reward_funcs=reward, args=cfg, train_dataset=ds,
                       processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[clock])
    trainer.train()
    steps = clock.steps
    print(json.dumps({"step_s": [s["wall"] for s in steps], "tokens": [s["tokens"] for s in steps],
                      "response_length": [sum(s["lengths"]) / len(s["lengths"]) for s in steps],
                      "phase_s": [phases(s["timers"], s["wall"], a.beta) for s in steps]}))


if __name__ == "__main__":
    main()
