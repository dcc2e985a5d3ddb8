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


# verl's recipe/one_step_off_policy/shell/dapo_7b_math_fsdp2_64_64.sh, key for key: local model and data, 1
# training + 1 rollout rank for its 64 + 64 GPUs (gen_tp, sp_size and fsdp_size 1: no sequence parallel
# here yet), CPU sizes (batch 4 for 512, mini-batch 4 for 32, n 2 for 16, responses of 16 tokens for 28,672
# with an overlong buffer of 4 for 4,096, prompts of 512 for 2,048 and the token budgets and max_resp_len
# that follow from them, a warm-up of 1 step for 10 of its 400). Added: the step count and the output
# folder. {engine}: as ONE_STEP_OFF_POLICY's.
DAPO_ONE_STEP_OFF_POLICY = """
    data.train_files={data}/train.parquet
    data.val_files={data}/test.parquet
    data.prompt_key=prompt
    data.truncation='left'
    data.max_prompt_length=512
    data.max_response_length=16
    data.train_batch_size=4
    actor_rollout_ref.rollout.n=2
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.strategy=fsdp2
    critic.strategy=fsdp2
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.hybrid_engine=False
    +actor_rollout_ref.model.override_config.max_position_embeddings=32768
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1056
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1584
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1584
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=1
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=528
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1
    {engine}
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.fsdp_config.fsdp_size=1
    reward_model.reward_manager=dapo
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=4
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False
    +reward_model.reward_kwargs.max_resp_len=16
    trainer.logger=['console','tensorboard']
    trainer.project_name='DAPO'
    trainer.experiment_name='dapo_qwen2-7B-math_28k_fsdp2_one_step_off_64-64'
    trainer.val_before_train=True
    trainer.test_freq=10
    trainer.save_freq=-1
    trainer.total_epochs=10
    trainer.total_training_steps=2
    trainer.default_local_dir={out}
    trainer.resume_mode=auto
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    rollout.nnodes=1
    rollout.n_gpus_per_node=1
"""


# verl's recipe/dapo/run_dapo_qwen2.5_32b.sh (the last version before recipe/ left verl's tree, 0088193ac^),
# key for key after its shell variables: dynamic sampling over generation batches of gen_prompt_bsz =
# 3 x train_prompt_bsz prompts, token budgets (use_dynamic_bsz, actor_ppo_max_token_len,
# infer_ppo_max_token_len) and Ulysses over sp_size ranks for the actor and the reference. Local model and
# data, and CPU sizes on 2 ranks: sp_size 2 for 8 (so the 2 ranks are one SP group), gen_tp 1 for 4,
# train_prompt_bsz 4 for 512 (gen_prompt_bsz 12), train_prompt_mini_bsz 2 for 32, n_resp_per_prompt 4 for
# 16, max_response_length 16 for 20,480 with overlong_buffer_len 4 for 4,096, max_prompt_length 64 for
# 2,048 (and the token budgets and batched tokens that follow from them), a warm-up of 1 step for 10 (of
# its epoch's; spmdrl refuses a warm-up longer than the run). Left out: the ray job submit
# wrapper (spmdrl needs no Ray) and actor_rollout_ref.rollout.name=vllm (spmdrl's own engine generates
# here). Added: the step count and the output folder.
DAPO_QWEN25_32B = """
    data.train_files={data}
    data.val_files={val}
    data.prompt_key=prompt
    data.truncation='left'
    data.max_prompt_length=64
    data.max_response_length=16
    data.gen_batch_size=12
    data.train_batch_size=4
    actor_rollout_ref.rollout.n=4
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    algorithm.filter_groups.enable=True
    algorithm.filter_groups.max_num_gen_batches=10
    algorithm.filter_groups.metric=acc
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=80
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=80
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=1
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=80
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=2
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
    reward_model.reward_manager=dapo
    reward_model.overlong_buffer.enable=True
    reward_model.overlong_buffer.len=4
    reward_model.overlong_buffer.penalty_factor=1.0
    trainer.logger='["console","wandb"]'
    trainer.project_name='DAPO'
    trainer.experiment_name='DAPO-Qwen2.5-32B'
    trainer.n_gpus_per_node=2
    trainer.nnodes=1
    trainer.val_before_train=True
    trainer.test_freq=5
    trainer.save_freq=5
    trainer.total_epochs=1
    trainer.default_local_dir={out}
    trainer.resume_mode=auto
    trainer.total_training_steps=2
"""
