"""verl's config keys mapped onto spmdrl's typed config: one table, one row per verl key.

    python -m spmdrl.verl.docs --write-docs        # regenerate docs/verl.md from TABLE

Each ``Rule`` names a verl key (its dotted path in verl's ppo_trainer.yaml),
the spmdrl key(s) it sets and the value conversion. Rows are accepted and
ignored with the info line when the key is about Ray, placement or resource
pools (torchrun places the ranks) or is a speed knob that changes no result;
``only`` rows accept the values spmdrl always behaves as and stop the run on
any other. ``translate`` applies the table; a verl key with no row stops the
run with one sentence naming it (exit 2), never silently ignored. The value
conversions the rows use are ``spmdrl.verl.converters``; the command line side
(Hydra words, ``--verl-config``, precedence) is ``spmdrl.verl.args``.
"""

from __future__ import annotations

from typing import Any, Optional

from spmdrl.errors import ConfigError
from spmdrl.verl.converters import (
    ACT,
    AR,
    GRADS_FREED,
    OFFLOAD_NOTE,
    SP_KEYS,
    _choice,
    _ckpt_contents,
    _clip_ratio,
    _custom_reward,
    _filter_overlong,
    _fsdp_size,
    _logger,
    _megatron_rows,
    _multi_turn_format,
    _offload,
    _path,
    _per_gpu,
    _resume_from_path,
    _resume_mode,
    _rollout_ranks,
    _same_sp,
    _same_strategy,
    _sp,
    _strategy,
    _top_k,
    _warmup_steps,
    _world,
)
from spmdrl.verl.rules import SKIP, Ctx, Rule, ignore, m, only, spmdrl_keys

# ----------------------------------------------------------------------------- the table

RO, OPT = f"{AR}.rollout", f"{AR}.actor.optim"
PLACEMENT = "Ray/placement: torchrun decides where ranks run"
PERF = "a speed knob with no spmdrl counterpart; results are unchanged"
TEXT_ONLY = "spmdrl trains on text prompts; image and video columns are not read"

TABLE: list[Rule] = [
    # data
    m("data.train_files", "data.train_files", _path, "~ is expanded"),
    m("data.val_files", "data.val_files", _path, "~ is expanded"),
    m("data.prompt_key", "data.prompt_key"),
    m("data.train_batch_size", "data.train_batch_size"),
    m("data.gen_batch_size", "data.gen_batch_size", note="prompts per round of DAPO's dynamic sampling"),
    m("data.val_batch_size", "data.val_batch_size", note="null (verl: the whole set) keeps spmdrl's default"),
    m("data.max_prompt_length", "data.max_prompt_length"),
    m("data.max_response_length", "data.max_response_length"),
    m("data.truncation", "data.truncation",
      _choice("data.truncation", {"error": "error", "left": "left", "right": "right"})),
    Rule("data.filter_overlong_prompts", "data.truncation", _filter_overlong,
         "true sets data.truncation: filter"),
    ignore("data.filter_overlong_prompts_workers", PERF),
    ignore("data.dataloader_num_workers", PERF),
    m("data.shuffle", "data.shuffle"),
    m("data.tokenizer", "model.tokenizer_path", _path),
    only("data.reward_fn_key", ("data_source",), "the scorer is chosen by each row's data_source"),
    ignore("data.return_raw_chat", "spmdrl keeps each prompt's text and tokens"),
    ignore("data.return_raw_input_ids",
           "the reward model re-renders prompt + response with its own template"),
    ignore("data.image_key", TEXT_ONLY),
    ignore("data.video_key", TEXT_ONLY),
    # model
    m(f"{AR}.model.path", "model.path", _path, "~ is expanded"),
    m(f"{AR}.model.enable_gradient_checkpointing", "model.enable_gradient_checkpointing"),
    m(f"{AR}.model.use_liger", "model.fused_kernels", lambda v: "on" if v else "off",
      "true: on, false: off (fused RMSNorm/SwiGLU)"),
    *(only(f"{AR}.model.override_config.{k}", (0, 0.0), "dropout stays off in training, as the models "
           "spmdrl loads have it (Qwen2, Llama: attention_dropout 0)")
      for k in ("attention_dropout", "embd_pdrop", "resid_pdrop")),
    m(f"{AR}.model.override_config.max_position_embeddings", "model.max_position_embeddings",
      note="the one config.json override spmdrl takes (its DAPO recipes' longer responses)"),
    m(f"{AR}.model.lora_rank", "model.lora_rank"),
    m(f"{AR}.model.lora_alpha", "model.lora_alpha"),
    m(f"{AR}.model.target_modules", "model.target_modules"),
    m(f"{AR}.model.exclude_modules", "model.exclude_modules"),
    m(f"{AR}.model.lora_adapter_path", "model.lora_adapter_path"),
    m(f"{AR}.model.use_remove_padding", "model.use_remove_padding",
      note="actor and reference forwards on packed sequences"),
    only(f"{AR}.model.external_lib", (None,), "transformers loads the model"),
    only(f"{AR}.model.return_last_hidden_state", (False,), "not supported"),
    only(f"{AR}.model.use_fused_loss", (False,), "the loss is computed from full log-probs"),
    m(f"{AR}.hybrid_engine", "rollout.placement", lambda v: "colocated" if v else "split",
      "false: split placement, rollout.nnodes x rollout.n_gpus_per_node ranks only generate (one-step "
      "off-policy, as verl's one_step_off_policy recipe)"),
    m("rollout.nnodes", "rollout.nnodes", note="split placement: nodes of rollout ranks"),
    m("rollout.n_gpus_per_node", "rollout.n_gpus_per_node", note="split placement: rollout ranks per node"),
    m(f"{AR}.nccl_timeout", "trainer.hang_timeout_s",
      note="the hang watchdog's limit per phase; the collective timeout is never shorter"),
    # actor
    m(f"{ACT}.strategy", "actor.strategy", _strategy, "fsdp and fsdp2 both mean fsdp2"),
    m(f"{ACT}.megatron.tensor_model_parallel_size", "parallel.tp"),
    m(f"{ACT}.megatron.pipeline_model_parallel_size", "parallel.pp"),
    *_megatron_rows(f"{ACT}.megatron"),
    m(f"{ACT}.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    m(f"{ACT}.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    Rule(f"{ACT}.ppo_micro_batch_size", "actor.ppo_micro_batch_size_per_gpu",
         _per_gpu("actor.ppo_micro_batch_size_per_gpu"), "deprecated global size, divided by the world size"),
    m(f"{ACT}.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    m(f"{ACT}.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    m(f"{ACT}.ppo_epochs", "actor.ppo_epochs"),
    m(f"{ACT}.grad_clip", "actor.max_grad_norm"),
    Rule(f"{ACT}.clip_ratio", "actor.clip_ratio_low, actor.clip_ratio_high", _clip_ratio, "sets both sides"),
    m(f"{ACT}.clip_ratio_low", "actor.clip_ratio_low"),
    m(f"{ACT}.clip_ratio_high", "actor.clip_ratio_high"),
    m(f"{ACT}.clip_ratio_c", "actor.clip_ratio_c"),
    m(f"{ACT}.policy_loss.loss_mode", "actor.policy_loss"),
    # verl's older switch, before loss_agg_mode (which wins when both are given)
    m(f"{ACT}.use_token_level_loss", "actor.loss_agg_mode",
      lambda v: "token-mean" if v else "seq-mean-token-mean", "true: token-mean; false: seq-mean-token-mean"),
    m(f"{ACT}.loss_agg_mode", "actor.loss_agg_mode"),
    m(f"{ACT}.loss_scale_factor", "actor.loss_scale_factor"),
    m(f"{ACT}.entropy_coeff", "actor.entropy_coeff"),
    m(f"{ACT}.use_kl_loss", "actor.use_kl_loss"),
    m(f"{ACT}.kl_loss_coef", "actor.kl_loss_coef"),
    # MoE: routing replay (verl's router_replay.mode; R3 asks the rollout to return its routing, which the
    # native engine always does), and the load-balancing loss of Megatron's transformer config
    m(f"{AR}.rollout.enable_rollout_routing_replay", "actor.router_replay", lambda v: "R3" if v else SKIP,
      "true: actor.router_replay R3 (router_replay.mode, when given, decides)"),
    m(f"{ACT}.router_replay.mode", "actor.router_replay", note="disabled, R2 or R3; fsdp2"),
    m(f"{ACT}.megatron.router_replay.mode", "actor.router_replay",
      note="disabled, R2 or R3; MoE models train on fsdp2"),
    m(f"{ACT}.megatron.override_transformer_config.moe_aux_loss_coeff", "actor.moe_aux_loss_coef"),
    m(f"{ACT}.kl_loss_type", "actor.kl_loss_type"),
    *(Rule(k, "parallel.sp", _sp, "Ulysses over the training mesh's sp axis") for k in SP_KEYS),
    ignore(f"{ACT}.use_torch_compile", PERF),
    Rule(f"{ACT}.checkpoint.contents", "trainer.export_hf_on_save", _ckpt_contents,
         "model, optimizer and extra are always saved; hf_model sets trainer.export_hf_on_save"),
    only(f"{ACT}.shuffle", (False,), "mini-batches follow the rollout order"),
    m(f"{OPT}.lr", "actor.lr"),
    m(f"{OPT}.weight_decay", "actor.weight_decay"),
    m(f"{OPT}.betas", "actor.betas"),
    m(f"{OPT}.clip_grad", "actor.max_grad_norm"),
    m(f"{OPT}.lr_warmup_steps", "actor.lr_warmup_steps", _warmup_steps, "-1 (use the ratio) sets nothing"),
    only(f"{OPT}.lr_warmup_steps_ratio", (0, 0.0), "give lr_warmup_steps"),
    m(f"{OPT}.warmup_style", "actor.lr_scheduler",
      _choice(f"{OPT}.warmup_style", {"constant": "constant", "cosine": "cosine"})),
    m(f"{OPT}.lr_scheduler_type", "actor.lr_scheduler",
      _choice(f"{OPT}.lr_scheduler_type", {"constant": "constant", "cosine": "cosine"})),
    m(f"{OPT}.min_lr_ratio", "actor.min_lr_ratio"),
    ignore(f"{OPT}.total_training_steps", "spmdrl derives it from the run"),
    Rule(f"{ACT}.fsdp_config.fsdp_size", "parallel.dp_shard, parallel.dp_replicate", _fsdp_size,
         "k < world: shard over k ranks, replicate over world/k (HSDP)"),
    m(f"{ACT}.fsdp_config.offload_policy", "actor.cpu_offload"),
    Rule(f"{ACT}.fsdp_config.param_offload", "actor.cpu_offload",
         lambda v, ctx: {"actor.cpu_offload": True} if v else {},
         "true: FSDP2 CPU offload (parameters, gradients and optimizer state on the CPU)"),
    m(f"{ACT}.fsdp_config.optimizer_offload", "trainer.offload", _offload, OFFLOAD_NOTE),
    ignore(f"{ACT}.fsdp_config.grad_offload", GRADS_FREED),
    ignore(f"{ACT}.fsdp_config.reshard_after_forward", PERF),
    ignore(f"{ACT}.fsdp_config.wrap_policy.*", "FSDP2 wraps each decoder layer"),
    # rollout
    m(f"{RO}.name", "rollout.engine"),
    only(f"{RO}.mode", ("sync",), "the rollout engine runs in-process"),
    m(f"{RO}.tensor_model_parallel_size", "parallel.rollout_tp"),
    m(f"{RO}.n", "rollout.n"),
    m(f"{RO}.temperature", "rollout.temperature"),
    m(f"{RO}.calculate_log_probs", "rollout.calculate_log_probs"),
    m(f"{RO}.top_p", "rollout.top_p"),
    m(f"{RO}.top_k", "rollout.top_k", _top_k, "0 (hf: no top-k) becomes -1"),
    m(f"{RO}.do_sample", "rollout.temperature", lambda v: SKIP if v else 0.0,
      "false means greedy: temperature 0"),
    m(f"{RO}.dtype", "rollout.dtype"),
    m(f"{RO}.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    m(f"{RO}.ignore_eos", "rollout.ignore_eos"),
    m(f"{RO}.enforce_eager", "rollout.enforce_eager"),
    m(f"{RO}.cudagraph_capture_sizes", "rollout.cudagraph_capture_sizes"),
    m(f"{RO}.free_cache_engine", "rollout.free_cache_engine"),
    m(f"{RO}.max_num_batched_tokens", "rollout.max_num_batched_tokens"),
    m(f"{RO}.max_model_len", "rollout.max_model_len"),
    m(f"{RO}.max_num_seqs", "rollout.max_num_seqs"),
    m(f"{RO}.update_weights_bucket_megabytes", "rollout.update_weights_bucket_megabytes"),
    m(f"{RO}.log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu"),
    Rule(f"{RO}.log_prob_micro_batch_size", "actor.log_prob_micro_batch_size_per_gpu",
         _per_gpu("actor.log_prob_micro_batch_size_per_gpu"),
         "deprecated global size, divided by the world size"),
    m(f"{RO}.log_prob_use_dynamic_bsz", "actor.log_prob_use_dynamic_bsz"),
    m(f"{RO}.log_prob_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_gpu"),
    ignore(f"{RO}.load_format", "weights are pushed from the actor each step"),
    ignore(f"{RO}.layered_summon", "the FSDP2 export already gathers one unit at a time"),
    ignore(f"{RO}.enable_chunked_prefill", PERF),
    ignore(f"{RO}.disable_log_stats", "vLLM's own logging"),
    only(f"{RO}.use_fire_sampling", (False,), "not supported"),
    ignore(f"{RO}.prompt_length", "verl derives it from data.max_prompt_length"),
    ignore(f"{RO}.response_length", "verl derives it from data.max_response_length"),
    *[m(f"{RO}.val_kwargs.{k}", f"rollout.val_kwargs.{k}", _top_k if k == "top_k" else None)
      for k in ("n", "do_sample", "temperature", "top_p", "top_k")],
    *[m(f"{RO}.multi_turn.{k}", f"rollout.multi_turn.{k}", _path if k == "tool_config_path" else None)
      for k in ("enable", "max_assistant_turns", "max_tool_response_length", "tool_response_truncate_side",
                "tool_config_path", "max_parallel_calls")],
    m(f"{RO}.multi_turn.format", "rollout.multi_turn.format", _multi_turn_format,
      "chatml (older verl) means hermes"),
    # reference policy
    m(f"{AR}.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu"),
    Rule(f"{AR}.ref.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size_per_gpu",
         _per_gpu("ref.log_prob_micro_batch_size_per_gpu"),
         "deprecated global size, divided by the world size"),
    m(f"{AR}.ref.fsdp_config.param_offload", "ref.offload"),
    Rule(f"{AR}.ref.strategy", "", _same_strategy(f"{AR}.ref.strategy"), "must name actor.strategy"),
    *_megatron_rows(f"{AR}.ref.megatron"),
    ignore(f"{AR}.ref.use_torch_compile", PERF),
    *(Rule(k, "", _same_sp(k), "must be the actor's") for k in (f"{AR}.ref.ulysses_sequence_parallel_size",
                                                               f"{AR}.ref.fsdp_config.ulysses_sequence_parallel_size")),
    ignore(f"{AR}.ref.fsdp_config.reshard_after_forward", PERF),
    ignore(f"{AR}.ref.fsdp_config.wrap_policy.*", "FSDP2 wraps each decoder layer"),
    m(f"{AR}.ref.log_prob_use_dynamic_bsz", "ref.log_prob_use_dynamic_bsz"),
    m(f"{AR}.ref.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu"),
    # critic
    m("critic.model.path", "critic.model_path", _path),
    Rule("critic.strategy", "", _same_strategy("critic.strategy"), "must name actor.strategy"),
    *_megatron_rows("critic.megatron"),
    m("critic.optim.lr", "critic.lr"),
    m("critic.optim.weight_decay", "critic.weight_decay"),
    m("critic.optim.lr_warmup_steps", "critic.lr_warmup_steps", _warmup_steps,
      "-1 (use the ratio) sets nothing"),
    only("critic.optim.lr_warmup_steps_ratio", (0, 0.0), "give critic.optim.lr_warmup_steps"),
    only("critic.optim.warmup_style", ("constant",), "the critic's rate is constant after warm-up"),
    ignore("critic.optim.total_training_steps", "spmdrl derives it from the run"),
    m("critic.optim.clip_grad", "critic.max_grad_norm"),
    m("critic.grad_clip", "critic.max_grad_norm"),
    m("critic.ppo_mini_batch_size", "critic.ppo_mini_batch_size"),
    m("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu"),
    Rule("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu",
         _per_gpu("critic.ppo_micro_batch_size_per_gpu"),
         "deprecated global size, divided by the world size"),
    m("critic.ppo_epochs", "critic.ppo_epochs"),
    m("critic.cliprange_value", "critic.cliprange_value"),
    only("critic.model.fsdp_config.param_offload", (False,), "use actor.cpu_offload (it covers the critic)"),
    ignore("critic.model.fsdp_config.optimizer_offload",
           "trainer.offload (the actor's key) covers every model"),
    m("critic.model.lora_rank", "critic.lora_rank"),
    m("critic.model.lora_alpha", "critic.lora_alpha"),
    m("critic.model.target_modules", "critic.target_modules"),
    m("critic.model.use_remove_padding", "critic.use_remove_padding"),
    ignore("critic.rollout_n", "verl derives it from actor_rollout_ref.rollout.n"),
    ignore("critic.model.tokenizer_path", "the critic reads the policy's tokens"),
    ignore("critic.model.enable_gradient_checkpointing",
           "the critic follows model.enable_gradient_checkpointing"),
    only("critic.model.fsdp_config.offload_policy", (False,), "use actor.cpu_offload (it covers the critic)"),
    only("critic.model.fsdp_config.fsdp_size", (-1,), "the critic shares the actor's mesh"),
    ignore("critic.model.fsdp_config.reshard_after_forward", PERF),
    ignore("critic.model.fsdp_config.wrap_policy.*", "FSDP2 wraps each decoder layer"),
    m("critic.use_dynamic_bsz", "critic.use_dynamic_bsz"),
    m("critic.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"),
    m("critic.forward_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu"),
    ignore("critic.forward_micro_batch_size_per_gpu", PERF),
    Rule("critic.ulysses_sequence_parallel_size", "", _same_sp("critic.ulysses_sequence_parallel_size"),
         "must be the actor's"),
    only("critic.shuffle", (False,), "mini-batches follow the rollout order"),
    ignore("critic.checkpoint.contents", "the critic is saved with the actor"),
    # rewards
    m("reward_model.enable", "reward_model.enable"),
    m("reward_model.model.path", "reward_model.model.path", _path),
    ignore("reward_model.model.input_tokenizer",
           "spmdrl always decodes responses with the policy's tokenizer and re-renders prompt + response "
           "with the reward model's chat template (what verl does when it is set)"),
    m("reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size_per_gpu"),
    m("reward_model.max_length", "reward_model.max_length"),
    only("reward_model.reward_manager", ("naive", "dapo"),
         "rule scores come from reward.function; dapo's overlong buffer is reward.overlong_buffer"),
    Rule("reward_model.strategy", "", _same_strategy("reward_model.strategy", "reward_model.enable"),
         "must name actor.strategy when reward_model.enable (megatron has no reward model)"),
    m("reward_model.model.use_remove_padding", "reward_model.model.use_remove_padding"),
    ignore("reward_model.model.fsdp_config.wrap_policy.*", "FSDP2 wraps each decoder layer"),
    ignore("reward_model.model.fsdp_config.reshard_after_forward", PERF),
    only("reward_model.model.fsdp_config.param_offload", (False,), "not supported"),
    only("reward_model.model.fsdp_config.fsdp_size", (-1,), "the reward model shares the actor's mesh"),
    Rule("reward_model.ulysses_sequence_parallel_size", "",
         _same_sp("reward_model.ulysses_sequence_parallel_size", "reward_model.enable"),
         "must be the actor's when reward_model.enable"),
    m("reward_model.use_dynamic_bsz", "reward_model.use_dynamic_bsz"),
    m("reward_model.forward_max_token_len_per_gpu", "reward_model.forward_max_token_len_per_gpu"),
    ignore("reward_model.launch_reward_fn_async", PERF),
    ignore("reward_model.enable_resource_pool", PLACEMENT),
    ignore("reward_model.n_gpus_per_node", PLACEMENT),
    ignore("reward_model.nnodes", PLACEMENT),
    # the dapo manager's buffer, in verl's older form and in its reward_kwargs form (the recipes' today)
    *[m(f"{prefix}.{k}", f"reward.overlong_buffer.{k}")
      for prefix in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg",
                     "custom_reward_function.overlong_buffer")  # the last: recipe/dapo's 32B scripts
      for k in ("enable", "len", "penalty_factor")],
    ignore("reward_model.reward_kwargs.overlong_buffer_cfg.log",
           "the penalty is logged as reward/overlong/mean and /ratio whenever it is on"),
    m("reward_model.reward_kwargs.max_resp_len", "reward.overlong_buffer.max_resp_len"),
    Rule("custom_reward_function.path", "reward.function", _custom_reward,
         "with custom_reward_function.name: path.py:name"),
    Rule("custom_reward_function.name", "reward.function", lambda v, ctx: {},
         "read with custom_reward_function.path"),
    # algorithm
    *[m(f"algorithm.{k}", f"algorithm.{k}")
      for k in ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward",
                "kl_penalty")],
    *[m(f"algorithm.kl_ctrl.{k}", f"algorithm.kl_ctrl.{k}")
      for k in ("type", "kl_coef", "target_kl", "horizon")],
    *[m(f"algorithm.filter_groups.{k}", f"algorithm.filter_groups.{k}")
      for k in ("enable", "max_num_gen_batches")],
    only("algorithm.filter_groups.metric", ("acc", "score"),
         "groups whose scores are all equal are dropped (the same as acc for 0/1 rewards)"),
    *[m(f"algorithm.rollout_correction.{k}", f"algorithm.rollout_correction.{k}")
      for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                "rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                "bypass_mode")],
    only("algorithm.rollout_correction.use_policy_gradient", (False,),
         "bypass mode keeps the PPO-clip loss, whose ratio is then taken against the rollout policy"),
    # trainer
    m("trainer.total_epochs", "trainer.total_epochs"),
    m("trainer.total_training_steps", "trainer.total_steps"),
    m("trainer.project_name", "trainer.project_name"),
    m("trainer.experiment_name", "trainer.experiment_name"),
    m("trainer.logger", "trainer.logger", _logger,
      "one name or a list; jsonl (metrics.jsonl) is always kept"),
    Rule("trainer.nnodes", "", _world, "n_gpus_per_node x nnodes (plus split placement's rollout ranks) must "
         "equal torchrun's world size"),
    Rule("trainer.n_gpus_per_node", "", _world, "n_gpus_per_node x nnodes (plus split placement's rollout "
         "ranks) must equal torchrun's world size"),
    m("trainer.device", "trainer.device"),
    m("trainer.save_freq", "trainer.save_freq"),
    m("trainer.test_freq", "trainer.test_freq"),
    m("trainer.val_before_train", "trainer.val_before_train"),
    m("trainer.val_only", "trainer.val_only"),
    Rule("trainer.resume_mode", "trainer.resume", _resume_mode,
         "auto: auto, disable: off, resume_path: trainer.resume_from_path"),
    Rule("trainer.resume_from_path", "trainer.resume", _resume_from_path, "read with trainer.resume_mode"),
    m("trainer.default_local_dir", "trainer.output_dir", _path,
      note="checkpoints go to its checkpoints/ folder"),
    m("trainer.max_actor_ckpt_to_keep", "trainer.keep_last", note="null keeps spmdrl's default"),
    only("trainer.critic_warmup", (0,), "the actor trains from the first step"),
    only("trainer.default_hdfs_dir", (None,), "write to a shared file system"),
    only("trainer.del_local_ckpt_after_load", (False,), "checkpoints are kept (trainer.keep_last)"),
    only("trainer.log_val_generations", (0,), "not supported yet"),
    m("trainer.balance_batch", "trainer.balance_batch", note="whole groups move, within a mini-batch slot"),
    ignore("trainer.ray_wait_register_center_timeout", PLACEMENT),
    ignore("ray_init.*", PLACEMENT),
    ignore("ray_kwargs.*", PLACEMENT),
]

# verl's own defaults where they differ from spmdrl's and change what a run does: a verl command line
# without algorithm.adv_estimator is PPO with a critic in verl, so it must be here too.
VERL_DEFAULTS: dict[str, Any] = {
    "trainer.balance_batch": True,
    f"{RO}.calculate_log_probs": False,
    "algorithm.adv_estimator": "gae",
    f"{RO}.n": 1,
    f"{OPT}.lr": 1e-6,
    f"{OPT}.weight_decay": 0.01,
    "critic.optim.lr": 1e-5,
    "critic.optim.weight_decay": 0.01,
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.truncation": "error",
    f"{ACT}.ppo_mini_batch_size": 256,
    "trainer.total_epochs": 30,
    "trainer.val_before_train": True,
}

# verl's interpolations: a key left out takes another key's value (critic.ppo_mini_batch_size: ${actor...}).
FOLLOWS: dict[str, str] = {
    "critic.ppo_mini_batch_size": f"{ACT}.ppo_mini_batch_size",
    "critic.ppo_epochs": f"{ACT}.ppo_epochs",
    f"{RO}.log_prob_max_token_len_per_gpu": f"{ACT}.ppo_max_token_len_per_gpu",
    f"{AR}.ref.log_prob_max_token_len_per_gpu": f"{ACT}.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
}


# ----------------------------------------------------------------------------- translation


_TARGET = ignore("*._target_", "Hydra's class marker of a config section, not a setting")


def rule_for(key: str, table: Optional[list[Rule]] = None) -> Optional[Rule]:
    if key.endswith("._target_"):
        return _TARGET
    return next((r for r in (TABLE if table is None else table) if r.matches(key)), None)


def _is_empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def translate(verl: dict[str, Any], world_size: int, *, table: Optional[list[Rule]] = None,
              config_cls: Optional[type] = None, given: frozenset[str] | set[str] = frozenset()
              ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Flattened verl keys -> (flattened spmdrl keys, spmdrl key -> verl key it came from, info notes).
    ``table`` / ``config_cls``: the RL trainer's (TABLE, Config) unless given (spmdrl.verl.sft's).
    ``given``: spmdrl keys a ``--config`` file sets; a verl link (FOLLOWS) or default (clip_ratio for both
    sides) never overrides them."""
    table = TABLE if table is None else table
    if table is TABLE:
        linked = {t: verl[s] for t, s in FOLLOWS.items()
                  if t not in verl and s in verl and rule_for(t, table).spmdrl not in given}
        verl = {**linked, **verl}
    ctx = Ctx(world_size, verl, frozenset(given))
    # Every key that cannot run is named at once: a recipe with several should not take a run per key.
    problems = [_unknown(k, verl[k], config_cls) for k in verl
                if rule_for(k, table) is None and not _is_empty(verl[k])]
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    why: dict[str, list[str]] = {"null or empty, so they set nothing":
                                 [k for k in verl if rule_for(k, table) is None]}
    # table order: later rows win (clip_ratio_low after clip_ratio, filter after truncation)
    for rule in table:
        for key in [k for k in verl if rule.matches(k)]:
            if rule.ignored:
                why.setdefault(rule.note, []).append(key)
                continue
            try:
                converted = rule.convert(verl[key], ctx)
            except ConfigError as err:
                problems.append(str(err))
                continue
            for target, value in converted.items():
                out[target] = value
                origin[target] = key
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} verl keys cannot run here: "
                          + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
    notes = [f"{', '.join(keys)} ({reason})" for reason, keys in why.items() if keys]
    return out, origin, notes


def _unknown(key: str, value: Any, config_cls: Optional[type]) -> str:
    """Why a key with no rule stops the run."""
    if key in spmdrl_keys(config_cls):
        return (f"{key}={value!r} is a spmdrl key, not a verl key; write it as --{key} {value!r} (key=value "
                f"words are verl's keys, see docs/verl.md)")
    return f"verl key {key}={value!r} has no spmdrl equivalent yet; remove it (docs/verl.md lists every " \
           f"verl key spmdrl maps)"


def check_world_size(verl: dict[str, Any], world_size: int) -> None:
    """verl places workers from these two keys; here torchrun does, so they must agree with it."""
    if "trainer.n_gpus_per_node" not in verl and "trainer.nnodes" not in verl:
        return
    per_node, nodes = verl.get("trainer.n_gpus_per_node", 8), verl.get("trainer.nnodes", 1)
    # Without the hybrid engine, verl's trainer.* ranks train and its rollout.* ranks generate: both count.
    split = verl.get("actor_rollout_ref.hybrid_engine") is False
    rollout = _rollout_ranks(verl)
    counted = isinstance(per_node, int) and isinstance(nodes, int)
    if not counted or per_node * nodes + rollout != world_size:
        extra = f" (+ {rollout} rollout ranks)" if split else ""
        raise ConfigError(
            f"verl keys trainer.n_gpus_per_node x trainer.nnodes = {per_node} x {nodes}{extra} do not match "
            f"the {world_size} rank(s) torchrun started (WORLD_SIZE); torchrun decides placement: start "
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m spmdrl.train ..., or drop these keys")
