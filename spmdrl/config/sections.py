"""Typed configuration for one spmdrl run.

Every section is a dataclass with defaults in code; a YAML file per experiment
(``configs/*.yaml``) overrides them and ``--section.key value`` overrides that.
jsonargparse does the parsing (unknown keys and wrong types are rejected there);
``validate`` checks ranges and cross-field consistency before any distributed
work starts. Leaf names follow verl where the concept is the same, so a verl
user can read a config at a glance.

    python -m spmdrl.train --config configs/grpo.yaml --actor.lr 1e-5
    python -m spmdrl.train --config configs/grpo.yaml --print_config
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from spmdrl.config.rollout import RolloutConfig


@dataclass
class DataConfig:
    train_files: Union[str, list[str]] = "builtin:arith"
    """Parquet file(s) in verl's layout, or ``builtin:<task>`` (generated on first use under the cache)."""
    val_files: Union[str, list[str], None] = "builtin:arith"
    """Validation parquet file(s), ``builtin:<task>``, or null for no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a plain string."""
    train_batch_size: int = 16
    """Prompts per step over the whole world (each is sampled ``rollout.n`` times)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation round under DAPO's dynamic sampling (``algorithm.filter_groups``; verl's
    ``data.gen_batch_size``): each round draws this many, and the step trains on the first
    ``train_batch_size`` groups kept. null: ``train_batch_size``. Without dynamic sampling a step trains on
    everything it generates, so there it must be null or equal ``train_batch_size``."""
    val_batch_size: int = 64
    """Prompts per validation batch over the whole world."""
    max_prompt_length: int = 64
    """Prompt tokens after the chat template; longer prompts are filtered or truncated."""
    max_response_length: int = 16
    """New tokens generated per response."""
    truncation: Literal["error", "left", "right", "filter"] = "filter"
    """What to do with a prompt over max_prompt_length: fail, keep the right or left end, or drop it."""
    shuffle: bool = True
    """Shuffle the training set each epoch (seeded by trainer.seed and the epoch)."""
    apply_chat_template: bool = True
    """Wrap message-list prompts with the tokenizer's chat template."""

    @property
    def draw_size(self) -> int:
        """Prompts one generation round draws from the training set (``gen_batch_size`` or the batch)."""
        return self.gen_batch_size or self.train_batch_size

    @property
    def draw_key(self) -> str:
        """The key that sets ``draw_size``, for messages about it."""
        return "data.gen_batch_size" if self.gen_batch_size else "data.train_batch_size"


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """Hugging Face model folder, or ``builtin:tiny`` / ``builtin:small`` (built offline on first use)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer folder when it differs from model.path."""
    max_position_embeddings: Optional[int] = None
    """The longest sequence the models are built for, in place of config.json's (verl's
    ``model.override_config.max_position_embeddings``: a recipe raising a math model's 4,096 positions for
    long responses). Every engine builds with it (transformers, vLLM's ``hf_overrides``, SGLang's model
    overrides, the native engine). Refused for a model whose RoPE numbers depend on it (``dynamic`` or
    ``longrope`` scaling; ``yarn`` or ``llama3`` without their own original length): there it would change
    the model, not only its limit."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype in which the trained weights are kept (the master copy)."""
    enable_gradient_checkpointing: Union[bool, Literal["auto"]] = "auto"
    """Recompute activations of each decoder layer in the backward pass. auto: only when the memory plan
    finds that the update does not fit without it (spmdrl/plan; spmdrl.sft makes no plan: off there)."""
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """Attention kernel of the trained models (transformers' ``attn_implementation``). auto: eager on CPU
    for sequences up to 2048 tokens (its bf16 backward is ~3x faster there than sdpa's CPU flash kernel,
    at O(length^2) memory), sdpa otherwise."""
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    """Fused RMSNorm and SwiGLU (torch.compile of those two functions only) in the trained models,
    as Liger kernels on GPU. auto: on for CPU training without TP when a C++ compiler is found;
    on: also elsewhere (needs triton on CUDA), error if impossible; off: transformers' eager modules."""
    use_torch_compile: Union[bool, Literal["auto"]] = "auto"
    """torch.compile each decoder layer of the trained models (FSDP2; verl's actor.use_torch_compile, which
    compiles its log-prob helpers instead). auto: on when training on CUDA, where it measured best (one
    H200, 0.5B shape: update 0.96 -> 0.69 s, reference pass 0.32 -> 0.20 s a step, for ~12 s of compile in
    the first step; docs/gpu.md), off on CPU, where the compile costs more than a short run wins."""
    use_remove_padding: bool = False
    """Actor and reference forwards run packed sequences (verl's use_remove_padding): the valid
    tokens of a micro-batch's rows in one row, attention kept within each sequence, so no projection,
    MLP or LM head runs on padding. Same results as padded rows (float32: 1e-5). The fsdp2 engine packs;
    the megatron engine runs the rows padded (the same results, without the saving). Off by default: on a
    2-core CPU it wins ~2x when rows average a quarter of the longest, and loses ~15% when every row is
    full (bench/packing.py)."""
    lora_rank: int = 0
    """LoRA rank of the actor (0: full fine-tuning). Adapters come from peft on the FSDP2 actor; only they
    are trained, get optimizer state and are checkpointed; the reference policy is the same model with its
    adapters off; the rollout engine receives merged weights (spmdrl/engines/fsdp2/lora.py)."""
    lora_alpha: float = 16
    """LoRA scaling numerator: adapters add (lora_alpha / lora_rank) * B @ A to each target weight."""
    target_modules: Union[str, list[str]] = "all-linear"
    """Modules that get adapters: peft's target_modules (all-linear: every linear layer but the LM head)."""
    exclude_modules: Union[str, list[str], None] = None
    """Modules left without adapters (peft's exclude_modules)."""
    lora_adapter_path: Optional[str] = None
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start the actor's
    adapters from; its r, lora_alpha and target_modules replace the three keys above."""


@dataclass
class ParallelConfig:
    dp_shard: int = -1
    """FSDP sharding degree of the training mesh; -1 means the rest of the world."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP) of the training mesh."""
    tp: int = 1
    """Tensor-parallel degree of the training mesh."""
    pp: int = 1
    """Pipeline-parallel degree of the training mesh (actor.strategy megatron: 1F1B schedule over the
    stages)."""
    sp: int = 1
    """Sequence-parallel degree of the training mesh (verl's Ulysses, actor.strategy fsdp2): the ranks of an
    SP group train the same rows, each a contiguous 1/sp slice of every packed sequence, and attention
    swaps sequence slices for head slices with an all-to-all. Packs sequences whatever
    model.use_remove_padding says; sp must divide the attention heads (docs/configuration.md)."""
    ep: int = 1
    """Expert-parallel degree of a Mixture-of-Experts model (actor.strategy fsdp2; verl's
    expert_model_parallel_size): ep consecutive FSDP ranks split every layer's experts, and each token's
    slots go to the ranks owning its experts and back by all-to-all. Plain FSDP only beside it
    (dp_replicate, tp, sp 1); ep must divide the FSDP ranks and the experts."""
    rollout_tp: int = 1
    """Tensor-parallel degree of the rollout mesh; rollout DP is world_size / rollout_tp."""


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    """Training engine (verl's actor.strategy) for actor, reference and critic: fsdp2, or megatron
    (megatron-core GPTModel cut parallel.tp x parallel.pp ways; actor and reference only)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    lr_warmup_steps: int = 0
    """Training steps of linear warm-up from 0 to lr (as verl, the schedule advances once per training
    step: every mini-batch of a step uses the same rate)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up; cosine reaches min_lr_ratio at the run's last training step."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is reported either way)."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step over the whole world (times rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: int = 16
    """Responses per forward/backward on one rank (gradient accumulation makes up the mini-batch)."""
    log_prob_micro_batch_size_per_gpu: int = 32
    """Responses per no-grad forward when computing old/ref log-probs."""
    use_dynamic_bsz: bool = False
    """Cut the actor's training micro-batches by tokens instead of rows (verl's use_dynamic_bsz):
    consecutive responses while their prompt + response tokens stay within ppo_max_token_len_per_gpu (a
    longer one alone). The update is the same (losses divide by the mini-batch's global counts); ranks
    with fewer micro-batches run zero-weight ones so collectives line up. fsdp2 only."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one training micro-batch on one rank, with use_dynamic_bsz."""
    log_prob_use_dynamic_bsz: bool = False
    """Cut the old-log-prob forwards by tokens (log_prob_max_token_len_per_gpu) instead of rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one old-log-prob forward on one rank, with log_prob_use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over the batch per step."""
    policy_loss: str = "vanilla"
    """Policy loss: vanilla (PPO clip, dual clip), gspo, gpg."""
    clip_ratio_low: float = 0.2
    """Lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher sets it above clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound (> 1) on the loss of negative-advantage tokens."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number; see spmdrl.algos.losses.agg_loss for each mode's length bias."""
    loss_scale_factor: Optional[float] = None
    """Constant divisor for seq-mean-token-sum-norm (default: max_response_length)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the actor loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), and '+' variants (k2 gradient)."""
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of forward and backward for actor, reference and critic (FSDP2 MixedPrecisionPolicy
    param_dtype; master weights, gradient reduction and optimizer state stay in model.dtype / reduce_dtype).
    auto: bfloat16 where the device runs it natively (verl's default on GPU; ~3x float32's rate on
    AVX512-BF16/AMX CPUs), float32 elsewhere (bf16 is emulated, ~40x slower, on AVX2-only CPUs)."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP2 MixedPrecisionPolicy reduce_dtype (gradient reduce-scatter dtype)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: keep sharded params, grads and optimizer state on the CPU."""
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    """Routing replay of a Mixture-of-Experts model (verl's router_replay.mode): each token takes the experts
    it was routed to before instead of its router's current top-k, whose weights still come from the
    router. R3: the rollout engine's routing, replayed in the old-log-prob, reference and update forwards
    (rollout.engine native records it); R2: the old-log-prob pass's routing, replayed in the update.
    disabled: every forward routes by itself."""
    moe_aux_loss_coef: float = 0.0
    """Weight of a Mixture-of-Experts model's load-balancing loss in the actor's update (the Switch
    Transformer's, as transformers computes it, over each micro-batch's tokens). 0, as NeMo-RL's GRPO recipes:
    it pulls the router toward an even load at the cost of moving its choices between rollout and update."""


@dataclass
class RefConfig:
    offload: bool = False
    """Keep the frozen reference policy's shards on the CPU between uses."""
    log_prob_micro_batch_size_per_gpu: int = 32
    """Responses per no-grad forward of the reference policy."""
    log_prob_use_dynamic_bsz: bool = False
    """Cut the reference forwards by tokens (log_prob_max_token_len_per_gpu) instead of rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one reference forward on one rank, with log_prob_use_dynamic_bsz."""


@dataclass
class CriticConfig:
    model_path: Optional[str] = None
    """Value model backbone folder (default: model.path); a scalar head is added."""
    lora_rank: int = 0
    """LoRA rank of the critic's backbone (0: full fine-tuning); the value head is trained whole."""
    lora_alpha: float = 16
    """The critic's LoRA scaling numerator (as model.lora_alpha)."""
    target_modules: Union[str, list[str]] = "all-linear"
    """The critic's modules that get adapters (as model.target_modules)."""
    lr: float = 1e-3
    """Peak learning rate of the critic's AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_warmup_steps: int = 0
    """Training steps of linear warm-up."""
    max_grad_norm: float = 1.0
    """Clip the critic's gradient norm to this (0 disables)."""
    ppo_epochs: int = 1
    """Passes over the batch per step."""
    ppo_mini_batch_size: int = 16
    """Prompts per critic optimizer step over the whole world."""
    ppo_micro_batch_size_per_gpu: int = 16
    """Responses per forward/backward on one rank."""
    use_remove_padding: bool = False
    """Critic forwards on packed sequences (as model.use_remove_padding for actor and reference)."""
    use_dynamic_bsz: bool = False
    """Cut the critic's micro-batches by tokens instead of rows: training by ppo_max_token_len_per_gpu,
    value forwards by forward_max_token_len_per_gpu (as actor.use_dynamic_bsz)."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one critic training micro-batch on one rank, with use_dynamic_bsz."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of one no-grad value forward on one rank, with use_dynamic_bsz."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """Controller of the in-reward KL coefficient."""
    kl_coef: float = 0.001
    """Initial (or fixed) KL coefficient."""
    target_kl: float = 0.1
    """Target KL of the adaptive controller."""
    horizon: int = 10000
    """Horizon (in samples) of the adaptive controller."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more."""
    max_num_gen_batches: int = 10
    """Most generation batches per step before training on what was kept (0: no limit)."""


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction: the gap between the rollout engine's distribution and the
    trainer's (see spmdrl/algos/rollout_correction.py). Its rollout_corr/* diagnostics are always logged."""

    rollout_is: Optional[Literal["token", "sequence"]] = None
    """Truncated importance sampling: weight each token's policy-gradient term by min(rho, threshold),
    rho = pi_train / pi_rollout of the token (token) or of the whole response (sequence); null: off."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the importance weights (verl's common range: 1.5-5 token, 2-10 sequence)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (mean 1)."""
    rollout_rs: Optional[Literal["token", "sequence", "geometric"]] = None
    """Rejection: tokens, or responses by the product or geometric mean of their ratios, whose ratio is
    outside [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss; null: off."""
    rollout_rs_threshold: Optional[float] = None
    """Upper ratio bound of rejection (needed with rollout_rs)."""
    rollout_rs_threshold_lower: Optional[float] = None
    """Lower ratio bound of rejection; null: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: Optional[float] = None
    """A response with any token ratio below this leaves the loss; null: off."""
    bypass_mode: bool = False
    """Use the rollout log-probs as the PPO old log-probs (no actor forward before the update: the PPO
    ratio is taken against the distribution that sampled); no diagnostics then."""

    @property
    def corrects(self) -> bool:
        """Whether weights or rejection change the loss (else only the diagnostics are logged)."""
        return self.rollout_is is not None or self.rollout_rs is not None \
            or self.rollout_token_veto_threshold is not None


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, gpg,
    opo."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (false gives Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: linear penalty over the last `len` tokens before max_response_length."""
    len: int = 4
    """Buffer length in tokens."""
    penalty_factor: float = 1.0
    """Penalty at max_response_length."""
    max_resp_len: Optional[int] = None
    """The length the penalty counts to (verl's DAPO reward manager's ``max_resp_len``); null:
    data.max_response_length. A smaller one penalizes past it too, on down the same line."""


@dataclass
class RewardConfig:
    function: str = "builtin"
    """``builtin`` (scorer chosen by each row's data_source) or ``path/to/file.py:function`` with verl's
    signature."""
    num_workers: int = 0
    """Scoring processes; 0 scores in-process (no timeout)."""
    timeout_s: float = 10.0
    """Seconds one score may take in a worker before it counts as 0."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    """Hugging Face sequence-classification model folder (num_labels 1) that scores prompt + response, or
    ``builtin:tiny-rm`` (built offline, for tests)."""
    use_remove_padding: bool = False
    """Score packed sequences (as model.use_remove_padding)."""


@dataclass
class RewardModelConfig:
    """A model-based reward (verl's reward_model section)."""

    enable: bool = False
    """Score responses with reward_model.model.path as well as (or instead of) the rule-based reward."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 16
    """Responses per no-grad forward of the reward model on one rank."""
    use_dynamic_bsz: bool = False
    """Cut the reward model's forwards by tokens (forward_max_token_len_per_gpu) instead of rows."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of one reward-model forward on one rank, with use_dynamic_bsz."""
    max_length: Optional[int] = None
    """Most tokens of a rendered prompt + response given to the reward model, cut on the right as verl's
    default truncation (null: no limit)."""
    rm_weight: float = 1.0
    """Weight of the reward model's score in the sequence reward: rm_weight * rm + rule_weight * rule."""
    rule_weight: float = 0.0
    """Weight of the rule-based reward (reward.function) next to the model's score; 0 (verl's behaviour: the
    model's score replaces the rule score) does not call the rule function at all."""


@dataclass
class TrainerConfig:
    project_name: str = "spmdrl"
    """Project name (wandb project, output folder)."""
    experiment_name: str = "grpo_tiny"
    """Experiment name (wandb run, output folder)."""
    output_dir: str = "outputs/{project_name}/{experiment_name}"
    """Folder for everything a run writes; {project_name} and {experiment_name} are filled in."""
    total_epochs: int = 1
    """Passes over the training set (total_steps wins when set). The run ends when they are used up, which
    with dynamic sampling (extra generation batches) can be before total_epochs x batches per epoch steps."""
    total_steps: Optional[int] = None
    """Training steps; null means total_epochs worth."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type; auto picks cuda when available."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console, jsonl, wandb, tensorboard."""
    save_freq: int = -1
    """Checkpoint every N steps and at the last step (-1: never)."""
    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str = "auto"
    """auto (newest complete checkpoint in output_dir), off, or a checkpoint folder."""
    export_hf_on_save: bool = False
    """Also write a Hugging Face folder of the actor at each save."""
    test_freq: int = -1
    """Validate every N steps (-1: never)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    balance_batch: bool = False
    """After the rollout, move whole groups of responses between ranks so each holds about the same
    number of tokens (verl's trainer.balance_batch; verl command lines get verl's default, true). Groups
    move only within one mini-batch slot, so group statistics and the update are unchanged
    (spmdrl/engines/balance.py); the gain is the wait of the ranks with short answers."""
    sleep_rollout: bool = True
    """Put the rollout engine to sleep (rollout.sleep_level) while training runs, so the two take turns on
    the device's memory (with rollout.free_cache_engine; split placement's rollout ranks never sleep). Its
    old name, trainer.colocate, still works."""
    offload: Literal["auto", "always", "never"] = "auto"
    """Move the actor's and critic's optimizer state off the device while the rollout engine is awake.
    auto: only when the memory plan finds that rollout does not fit next to it (verl's optimizer_offload
    maps to always / never); on CPU the device is the host, so nothing ever moves."""
    exact_memory: bool = False
    """CPU: give freed heap memory back to the OS at each phase start (glibc malloc_trim), so each phase's
    memory/*_peak_gb is its own (what the memory plan predicts) instead of the process's high-water mark so
    far; costs time (each phase faults its memory in again). GPUs measure allocated bytes either way."""
    plan_only: bool = False
    """Print the memory plan (bytes of every phase, what is decided and why) and exit, before any process
    group or model exists."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""
    val_only: bool = False
    """Only validate (with the initial or resumed weights), then exit (verl's trainer.val_only)."""
    plot_freq: int = -1
    """Write PNG figures of the run (spmdrl.plot) into output_dir every N steps and at the end (-1: never)."""
    rollout_data_dir: Optional[str] = None
    """Write every step's responses to {rollout_data_dir}/{step}.jsonl (verl's key: input, output, gts,
    score, step, plus index and sample: the prompt's id and the response's number), a folder inside
    output_dir (a relative path), set aside with the run's other files on a fresh start (null: none)."""
    hang_timeout_s: Optional[float] = 1800.0
    """Seconds a rank may spend in one phase (rollout, reward, update, checkpoint, ...) before it writes the
    Python stacks of its threads to stderr and exits with code 3, ending the job (0 or null: no watchdog).
    The collectives' own timeout is never shorter (at least the 30 minutes it always was), so this watchdog,
    which names the rank and phase, fires first."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def dump_config(cfg: Config) -> str:
    """YAML of the resolved config (written next to the run's outputs and into checkpoints)."""
    import yaml

    return yaml.safe_dump(asdict(cfg), sort_keys=False)


def output_dir(cfg: Config) -> Path:
    """``trainer.output_dir`` with {project_name} and {experiment_name} filled in."""
    t = cfg.trainer
    return Path(t.output_dir.format(project_name=t.project_name, experiment_name=t.experiment_name))
