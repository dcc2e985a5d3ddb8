"""verl's command lines and data that more than one test folder runs: its one-step-off-policy recipe (in the
main environment with the native engine, in .venv-vllm as written, with vLLM) and GSM8K-style parquet."""

from __future__ import annotations

import json
from pathlib import Path


def gsm8k_jsonl(path: Path, n: int, start: int) -> Path:
    rows = [{"question": f"Sam has {a} apples and buys {a + 3} more. How many apples does he have now?",
             "answer": f"{a} + {a + 3} = <<{a}+{a + 3}={2 * a + 3}>>{2 * a + 3}\n#### {2 * a + 3}"}
            for a in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gsm8k_parquet(root: Path) -> Path:
    """verl's GSM8K parquet layout (``root``/data/{train,test}.parquet), made by spmdrl.builtin.gsm8k from
    GSM8K-style JSONL rows: 8 training and 2 test questions."""
    from spmdrl.builtin.gsm8k import main as prepare

    assert prepare(["--input", str(gsm8k_jsonl(root / "train.jsonl", 8, 1)),
                    str(gsm8k_jsonl(root / "test.jsonl", 2, 20)), "--out", str(root / "data")]) == 0
    return root / "data"


# verl's recipe/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh, key for key: local model and data,
# 1 training + 1 rollout rank for its 6 + 2 GPUs, CPU sizes (batch 4 for 1152, mini-batch 4 for 192, n 2
# for 5, responses of 8 tokens for 1024). Added: the step count and the output folder. {engine} is its
# actor_rollout_ref.rollout.name=vllm where vLLM is installed, or empty (spmdrl's own engine generates).
ONE_STEP_OFF_POLICY = """
    algorithm.adv_estimator=grpo
    data.train_files={data}/train.parquet
    data.val_files={data}/test.parquet
    data.train_batch_size=4
    data.max_prompt_length=512
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.actor.strategy=fsdp2
    critic.strategy=fsdp2
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.hybrid_engine=False
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    {engine}
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=2
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.val_before_train=True
    trainer.logger=['console','tensorboard']
    trainer.project_name='GRPO'
    trainer.experiment_name='GRPO-Qwen3-0.6b-gsm8k-fsdp2-one-step-off-2-6'
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=2
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    rollout.nnodes=1
    rollout.n_gpus_per_node=1
    trainer.total_training_steps=2
    trainer.default_local_dir={out}
"""
