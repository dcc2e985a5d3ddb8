"""The checks a config passes before any work: ranges, names, sizes against the world, files on disk, and
each backend's own options. Every failure is one ConfigError sentence naming the key, the value and what is
allowed; ``spmdrl.train`` prints it and exits 2 before any process group exists.

    validate_config(cfg, world_size)
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Union

from spmdrl.checkpoint.run_folder import RUN_FILES
from spmdrl.config.moe import check_moe
from spmdrl.config.sections import Config, output_dir
from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.parallel import ParallelDims

# Estimators whose baseline is the group of n responses to one prompt.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "opo")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")


def validate_config(cfg: Config, world_size: int) -> None:
    """Range and consistency checks that need no process group, in the order a user meets them (cheap ones
    first, then files on disk and each backend's options); raises ConfigError."""
    _check_ranges(cfg)
    _check_token_budgets(cfg)
    _check_optimizer(cfg)
    _check_kl_and_dapo(cfg)
    _check_output_dir(cfg)
    _check_split(cfg)  # before the engines' own checks: a split run refuses an engine it cannot run yet
    _check_names(cfg)
    _check_features(cfg)
    _check_device(cfg)
    dims = _check_sizes(cfg, world_size)
    _check_builtin_names(cfg)
    _check_model_folders(cfg)
    _check_lora_ranks(cfg)
    _check_backends(cfg)
    check_moe(cfg)
    _check_inputs(cfg, dims)
    _check_data(cfg)


def _files(spec) -> list[str]:
    if spec is None:
        return []
    return [spec] if isinstance(spec, str) else list(spec)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_ranges(cfg: Config) -> None:
    """Numbers inside their ranges."""
    d, r, a, c, alg, t = cfg.data, cfg.rollout, cfg.actor, cfg.critic, cfg.algorithm, cfg.trainer
    for key, value in (("actor.lr", a.lr), ("critic.lr", c.lr)):
        _check(value > 0, f"{key} is {value}; the learning rate must be > 0")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(a, key)
        _check(value > 0, f"actor.{key} is {value}; clip ratios must be > 0")
    _check(a.clip_ratio_c > 1, f"actor.clip_ratio_c is {a.clip_ratio_c}; the dual-clip bound must be > 1")
    _check(c.cliprange_value > 0, f"critic.cliprange_value is {c.cliprange_value}; it must be > 0")
    for key, rank, alpha in (("model", cfg.model.lora_rank, cfg.model.lora_alpha),
                             ("critic", c.lora_rank, c.lora_alpha)):
        _check(rank >= 0, f"{key}.lora_rank is {rank}; it must be >= 0 (0: no LoRA)")
        _check(rank == 0 or alpha > 0, f"{key}.lora_alpha is {alpha}; it must be > 0")
    _check(r.temperature >= 0, f"rollout.temperature is {r.temperature}; it must be >= 0 (0 means greedy)")
    _check(r.val_kwargs.temperature >= 0,
           f"rollout.val_kwargs.temperature is {r.val_kwargs.temperature}; it must be >= 0")
    _check(0 < r.val_kwargs.top_p <= 1,
           f"rollout.val_kwargs.top_p is {r.val_kwargs.top_p}; it must be in (0, 1]")
    _check(r.val_kwargs.top_k == -1 or r.val_kwargs.top_k > 0,
           f"rollout.val_kwargs.top_k is {r.val_kwargs.top_k}; it must be -1 (all tokens) or > 0")
    _check(0 < r.top_p <= 1, f"rollout.top_p is {r.top_p}; it must be in (0, 1]")
    _check(r.top_k == -1 or r.top_k > 0, f"rollout.top_k is {r.top_k}; it must be -1 (all tokens) or > 0")
    for key, value in (
        ("rollout.n", r.n),
        ("rollout.val_kwargs.n", r.val_kwargs.n),
        ("rollout.max_num_seqs", r.max_num_seqs),
        ("data.train_batch_size", d.train_batch_size),
        ("data.val_batch_size", d.val_batch_size),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
        ("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu),
        ("actor.log_prob_micro_batch_size_per_gpu", a.log_prob_micro_batch_size_per_gpu),
        ("actor.ppo_epochs", a.ppo_epochs),
        ("critic.ppo_epochs", c.ppo_epochs),
        ("critic.ppo_mini_batch_size", c.ppo_mini_batch_size),
        ("critic.ppo_micro_batch_size_per_gpu", c.ppo_micro_batch_size_per_gpu),
        ("trainer.total_epochs", t.total_epochs),
        ("trainer.keep_last", t.keep_last),
    ):
        _check(value >= 1, f"{key} is {value}; it must be an integer >= 1")
    _check(t.total_steps is None or t.total_steps >= 1,
           f"trainer.total_steps is {t.total_steps}; it must be >= 1 or null")
    _check(t.hang_timeout_s is None or 0 <= t.hang_timeout_s < math.inf,
           f"trainer.hang_timeout_s is {t.hang_timeout_s}; it must be a number of seconds > 0, or 0 or null "
           f"(no watchdog)")
    for key in ("save_freq", "test_freq", "plot_freq"):
        value = getattr(t, key)
        _check(value == -1 or value >= 1, f"trainer.{key} is {value}; it must be -1 (never) or >= 1")
    _check(a.entropy_coeff >= 0, f"actor.entropy_coeff is {a.entropy_coeff}; it must be >= 0")
    _check(a.kl_loss_coef >= 0, f"actor.kl_loss_coef is {a.kl_loss_coef}; it must be >= 0")
    _check(a.moe_aux_loss_coef >= 0, f"actor.moe_aux_loss_coef is {a.moe_aux_loss_coef}; it must be >= 0")
    _check(0 <= alg.gamma <= 1, f"algorithm.gamma is {alg.gamma}; it must be in [0, 1]")
    _check(0 <= alg.lam <= 1, f"algorithm.lam is {alg.lam}; it must be in [0, 1]")
    _check(r.gpu_memory_utilization is None or 0 < r.gpu_memory_utilization <= 1,
           f"rollout.gpu_memory_utilization is {r.gpu_memory_utilization}; it must be in (0, 1], or null "
           f"(the memory plan sizes it)")


def _check_token_budgets(cfg: Config) -> None:
    """Micro-batch token budgets (use_dynamic_bsz) must hold at least one token; a row longer than the
    budget still runs, alone in its micro-batch."""
    for section, flag, budget in (
        ("actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        ("actor", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
        ("ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
        ("critic", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        ("critic", "use_dynamic_bsz", "forward_max_token_len_per_gpu"),
        ("reward_model", "use_dynamic_bsz", "forward_max_token_len_per_gpu"),
    ):
        sec = getattr(cfg, section)
        value = getattr(sec, budget)
        _check(not getattr(sec, flag) or (isinstance(value, int) and value >= 1),
               f"{section}.{budget} is {value} with {section}.{flag}: true; a micro-batch token budget "
               f"must be an integer >= 1")


def _check_optimizer(cfg: Config) -> None:
    """AdamW and schedule values of the actor and the critic inside the ranges where they mean something."""
    a, c, t = cfg.actor, cfg.critic, cfg.trainer
    for role, o in (("actor", a), ("critic", c)):
        _check(o.lr <= 1, f"{role}.lr is {o.lr}; a learning rate above 1 makes AdamW diverge at once "
                          f"(typical values: 1e-6 to 1e-3)")
        _check(o.weight_decay >= 0, f"{role}.weight_decay is {o.weight_decay}; it must be >= 0")
        _check(o.max_grad_norm >= 0,
               f"{role}.max_grad_norm is {o.max_grad_norm}; it must be > 0, or 0 to disable clipping")
        _check(o.lr_warmup_steps >= 0, f"{role}.lr_warmup_steps is {o.lr_warmup_steps}; it must be >= 0")
        _check(t.total_steps is None or o.lr_warmup_steps <= t.total_steps,
               f"{role}.lr_warmup_steps ({o.lr_warmup_steps}) is more than trainer.total_steps "
               f"({t.total_steps}); the learning rate would never reach {role}.lr")
    _check(len(a.betas) == 2 and all(0 <= b < 1 for b in a.betas),
           f"actor.betas is {list(a.betas)}; AdamW needs two betas in [0, 1)")
    _check(0 <= a.min_lr_ratio <= 1, f"actor.min_lr_ratio is {a.min_lr_ratio}; it must be in [0, 1]")
    _check(cfg.reward.num_workers >= 0, f"reward.num_workers is {cfg.reward.num_workers}; it must be >= 0 "
                                        f"(0 scores in-process)")
    _check(cfg.reward.timeout_s > 0, f"reward.timeout_s is {cfg.reward.timeout_s}; it must be > 0")


def _check_kl_and_dapo(cfg: Config) -> None:
    """KL terms, their controller and DAPO's options against each other and the lengths they refer to."""
    a, alg, d, r = cfg.actor, cfg.algorithm, cfg.data, cfg.rollout
    kc, fg, ob = alg.kl_ctrl, alg.filter_groups, cfg.reward.overlong_buffer
    _check(a.clip_ratio_low < 1, f"actor.clip_ratio_low is {a.clip_ratio_low}; it must be < 1 (the ratio's "
                                 f"lower bound is 1 - clip_ratio_low)")
    _check(a.clip_ratio_low <= a.clip_ratio_high,
           f"actor.clip_ratio_low ({a.clip_ratio_low}) is above actor.clip_ratio_high ({a.clip_ratio_high}); "
           f"DAPO's clip-higher sets clip_ratio_high >= clip_ratio_low")
    _check(not a.use_kl_loss or a.kl_loss_coef > 0,
           "actor.use_kl_loss is true but actor.kl_loss_coef is 0, so a reference model would be loaded for "
           "nothing; set kl_loss_coef > 0 or use_kl_loss false")
    _check(kc.kl_coef >= 0, f"algorithm.kl_ctrl.kl_coef is {kc.kl_coef}; it must be >= 0")
    _check(not alg.use_kl_in_reward or kc.kl_coef > 0,
           "algorithm.use_kl_in_reward is true but algorithm.kl_ctrl.kl_coef is 0, so the penalty stays 0 "
           "(an adaptive controller only scales it); set kl_coef > 0 or use_kl_in_reward false")
    if kc.type == "adaptive":
        _check(kc.target_kl > 0, f"algorithm.kl_ctrl.target_kl is {kc.target_kl}; the adaptive controller "
                                 f"needs a target KL > 0")
        _check(kc.horizon >= 1, f"algorithm.kl_ctrl.horizon is {kc.horizon}; the adaptive controller needs a "
                                f"horizon >= 1")
    _check(fg.max_num_gen_batches >= 0, f"algorithm.filter_groups.max_num_gen_batches is "
                                        f"{fg.max_num_gen_batches}; it must be >= 0 (0: no limit)")
    gen = d.gen_batch_size
    _check(gen is None or gen >= 1, f"data.gen_batch_size is {gen}; it must be an integer >= 1 or null")
    _check(gen is None or gen == d.train_batch_size or fg.enable,
           f"data.gen_batch_size is {gen} but data.train_batch_size is {d.train_batch_size} and "
           f"algorithm.filter_groups.enable is false: without dynamic sampling a step trains on every prompt "
           f"it generates; leave data.gen_batch_size null or enable filter_groups")
    _check(not fg.enable or r.n >= 2,
           f"algorithm.filter_groups.enable is true with rollout.n {r.n}: a group of one response always "
           f"has equal rewards and would be dropped; filter_groups needs rollout.n >= 2")
    if ob.enable:
        limit, name = ((ob.max_resp_len, "reward.overlong_buffer.max_resp_len") if ob.max_resp_len is not None
                       else (d.max_response_length, "data.max_response_length"))
        _check(0 < ob.len <= limit,
               f"reward.overlong_buffer.len is {ob.len}; it must be in (0, {name}={limit}]")
        _check(ob.penalty_factor >= 0,
               f"reward.overlong_buffer.penalty_factor is {ob.penalty_factor}; it must be >= 0")


def _check_device(cfg: Config) -> None:
    """trainer.device names a device this machine has."""
    from spmdrl.parallel import resolve_device_type

    try:
        resolve_device_type(cfg.trainer.device)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _check_output_dir(cfg: Config) -> None:
    """Run names that stay one folder name (``../../x`` would write outside outputs/), and an output_dir
    template that uses only the fields it is given."""
    t = cfg.trainer
    for key in ("project_name", "experiment_name"):
        name = getattr(t, key)
        _check(bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0"),
               f"trainer.{key} is {name!r}; it must be one folder name (no '/' or '\\', not '.' or '..'), "
               f"because trainer.output_dir puts it in a path")
    d = t.rollout_data_dir
    inside = d is None or (bool(d) and not Path(d).is_absolute() and ".." not in Path(d).parts
                           and Path(d).parts[0] not in RUN_FILES)
    _check(inside, f"trainer.rollout_data_dir is {d!r}; it must be a folder inside trainer.output_dir (a "
                   f"relative path without '..', not one of the run's own {', '.join(RUN_FILES)}), so a "
                   f"fresh start sets an earlier run's generations aside instead of mixing them")
    try:
        output_dir(cfg)
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"trainer.output_dir is {t.output_dir!r}, which the run cannot fill in "
                          f"({type(err).__name__}: {err}); it may use {{project_name}} and "
                          f"{{experiment_name}}") from None


def _check_names(cfg: Config) -> None:
    """Names that select components (registries, engines, loggers)."""
    import spmdrl.algos  # noqa: F401  (fills the registries)
    from spmdrl.algos.registry import ADVANTAGES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
    from spmdrl.engines import ENGINES
    from spmdrl.rollout import ROLLOUT_ENGINES

    r, a, alg, t = cfg.rollout, cfg.actor, cfg.algorithm, cfg.trainer
    for key, value, valid in (
        ("algorithm.adv_estimator", alg.adv_estimator, ADVANTAGES.names()),
        ("actor.policy_loss", a.policy_loss, POLICY_LOSSES.names()),
        ("actor.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES.names()),
        ("actor.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS.names()),
        ("algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS.names()),
        ("rollout.engine", r.engine, sorted(ROLLOUT_ENGINES)),
        ("actor.strategy", a.strategy, sorted(ENGINES)),
    ):
        _check(value in valid, f"{key} is {value!r}; valid values: {', '.join(valid)}")
    for name in t.logger:
        _check(name in LOGGERS, f"trainer.logger has {name!r}; valid loggers: {', '.join(LOGGERS)}")
        # Checked here: rank 0 opens the loggers only after every rank has loaded its models.
        _check(name not in ("wandb", "tensorboard") or importlib.util.find_spec(name) is not None,
               f"trainer.logger has {name!r} but the {name} package is not installed; pip install {name}")
    _check(
        not (alg.adv_estimator in GROUP_ESTIMATORS and r.n < 2),
        f"rollout.n is {r.n} but algorithm.adv_estimator {alg.adv_estimator!r} compares the responses of a "
        f"prompt; it needs rollout.n >= 2",
    )


def _check_features(cfg: Config) -> None:
    """Features whose keys need each other."""
    d, t = cfg.data, cfg.trainer
    if cfg.reward_model.enable:
        _check_reward_model(cfg)
    _check_rollout_correction(cfg)
    _check(t.plot_freq == -1 or "jsonl" in t.logger,
           f"trainer.plot_freq is {t.plot_freq} but trainer.logger {t.logger} has no jsonl; the figures are "
           f"drawn from metrics.jsonl")
    _check(not t.val_only or bool(_files(d.val_files)),
           "trainer.val_only is true but data.val_files is null; validation-only needs validation files")


def _check_rollout_correction(cfg: Config) -> None:
    """algorithm.rollout_correction's bounds and what it needs from sampling."""
    rc, r = cfg.algorithm.rollout_correction, cfg.rollout
    key = "algorithm.rollout_correction"
    _check(rc.rollout_is_threshold > 0,
           f"{key}.rollout_is_threshold is {rc.rollout_is_threshold}; it must be > 0")
    _check(rc.rollout_rs is None or rc.rollout_rs_threshold is not None,
           f"{key}.rollout_rs is {rc.rollout_rs} but rollout_rs_threshold is null; rejection needs its bound")
    upper, lower = rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower
    _check(upper is None or upper > 0, f"{key}.rollout_rs_threshold is {upper}; it must be > 0")
    _check(lower is None or (lower > 0 and (upper is None or lower < upper)),
           f"{key}.rollout_rs_threshold_lower is {lower}; it must be > 0 and below rollout_rs_threshold "
           f"({upper})")
    veto = rc.rollout_token_veto_threshold
    _check(veto is None or 0 < veto < 1,
           f"{key}.rollout_token_veto_threshold is {veto}; it must be in (0, 1)")
    _check(r.calculate_log_probs or not (rc.bypass_mode or rc.corrects),
           f"{key} uses the rollout engine's log-probs, but rollout.calculate_log_probs is false; set it to "
           f"true (verl: actor_rollout_ref.rollout.calculate_log_probs=True)")
    _check(not (rc.bypass_mode and rc.corrects),
           f"{key}.bypass_mode takes the rollout log-probs as the old ones, so there is no ratio to correct; "
           f"set rollout_is, rollout_rs and rollout_token_veto_threshold to null or bypass_mode to false")
    _check(not rc.corrects or (r.top_k <= 0 and r.top_p >= 1.0),
           f"{key} corrects with the rollout engine's log-probs, which with rollout.top_k {r.top_k} / top_p "
           f"{r.top_p} are of a truncated distribution; sample from the full one (top_k -1, top_p 1.0)")


def _check_split(cfg: Config) -> None:
    """rollout.placement split: its keys, and what it does not run yet (each with one sentence)."""
    r = cfg.rollout
    if r.placement != "split":
        return
    _check(r.n_gpus_per_node is not None and r.n_gpus_per_node >= 1 and r.nnodes >= 1,
           f"rollout.placement is split but rollout.nnodes x rollout.n_gpus_per_node is {r.nnodes} x "
           f"{r.n_gpus_per_node}; give the rollout ranks (verl: rollout.nnodes=1 rollout.n_gpus_per_node=1)")
    _check(r.max_staleness >= 0,
           f"rollout.max_staleness is {r.max_staleness}; it must be >= 0 (0: the rollout waits for each "
           f"update; 1: one-step off-policy; s: batches generated with weights s updates old)")
    from spmdrl.rollout import ROLLOUT_ENGINES, rollout_engine_class

    # An unknown engine name is said by the names' check.
    _check(r.engine not in ROLLOUT_ENGINES or rollout_engine_class(r.engine).runs_split,
           f"rollout.engine {r.engine} is not built for rollout.placement split yet; use rollout.engine "
           f"native or rollout.placement colocated")


def _check_sizes(cfg: Config, world_size: int) -> "ParallelDims":
    """Batch sizes against each other and the world; the parallel degrees against the world size."""
    from spmdrl.parallel import ParallelDims

    d, r, a = cfg.data, cfg.rollout, cfg.actor
    try:
        dims = ParallelDims.of(cfg, world_size)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    world_size = dims.train_ranks  # the ranks the batch is sharded over for training
    _check(
        d.train_batch_size % dims.rollout_dp == 0,
        f"data.train_batch_size x rollout.n = {d.train_batch_size} x {r.n} responses cannot be split over "
        f"{dims.rollout_dp} data-parallel ranks with all n responses of a prompt on one rank; make "
        f"data.train_batch_size a multiple of {dims.rollout_dp}",
    )
    _check(
        d.gen_batch_size is None or d.gen_batch_size % dims.rollout_dp == 0,
        f"data.gen_batch_size is {d.gen_batch_size}: a generation round's prompts cannot be split over "
        f"{dims.rollout_dp} data-parallel ranks with all n responses of a prompt on one rank; make it a "
        f"multiple of {dims.rollout_dp}",
    )
    _check(
        d.train_batch_size % world_size == 0,
        f"data.train_batch_size is {d.train_batch_size}: each of the {dims.rollout_dp} rollout TP groups of "
        f"{dims.rollout_tp} ranks generates {d.train_batch_size // dims.rollout_dp} prompts and each rank "
        f"keeps 1/{dims.rollout_tp} of them as whole groups; make data.train_batch_size a multiple of "
        f"{world_size}",
    ) if dims.rollout_tp > 1 else None
    from spmdrl.algos.registry import ADVANTAGES

    minis = [("actor", a.ppo_mini_batch_size)]
    if ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_values"):  # the critic trains too
        minis.append(("critic", cfg.critic.ppo_mini_batch_size))
    for role, mini in minis:
        _check(mini <= d.train_batch_size,
               f"{role}.ppo_mini_batch_size ({mini}) is larger than data.train_batch_size "
               f"({d.train_batch_size}); a mini-batch is a part of the batch")
        _check(d.train_batch_size % mini == 0,
               f"data.train_batch_size ({d.train_batch_size}) is not a multiple of "
               f"{role}.ppo_mini_batch_size ({mini})")
        # Whole groups per rank: over the rollout DP ranks, and over the training ranks when they differ.
        whole = math.lcm(dims.rollout_dp, dims.train_ranks if dims.split else 1)
        _check((mini * r.n) % world_size == 0 and mini % whole == 0,
               f"{role}.ppo_mini_batch_size x rollout.n = {mini} x {r.n} does not split evenly over "
               f"{world_size} ranks (whole groups of n responses per rank); make {role}.ppo_mini_batch_size "
               f"a multiple of {whole}")
    return dims


def _check_builtin_names(cfg: Config) -> None:
    """Every ``builtin:`` model and task name is one spmdrl knows (they are built only after start-up)."""
    from spmdrl.builtin import check_builtin_names

    try:
        check_builtin_names(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _check_data(cfg: Config) -> None:
    """Parquet rows (types, chat messages, ground truths) and their data sources against the scorers."""
    from spmdrl.config.inputs import check_data_files

    check_data_files(cfg)


def _check_sp_heads(cfg: Config) -> None:
    """Under sequence parallelism every trained or scored model's attention heads split over parallel.sp."""
    from spmdrl.builtin.models import builtin_config
    from spmdrl.config.model_folder import check_sp_heads, read_config, text_config

    if cfg.parallel.sp == 1:
        return
    rm = cfg.reward_model.model.path if cfg.reward_model.enable else None
    for key, path in (("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path),
                      ("reward_model.model.path", rm)):
        if path is not None:
            c = builtin_config(path) if path.startswith("builtin:") else read_config(path, key)
            try:
                check_sp_heads(cfg.parallel.sp, text_config(c), f"{key} {path!r}")
            except ValueError as err:
                raise ConfigError(str(err)) from None


def _check_model_folders(cfg: Config) -> None:
    """Model folders (config, weights, tokenizer), cheaply, before the backends' checks read them."""
    from spmdrl.config.model_folder import (
        check_vocab,
        read_config,
        text_config,
        validate_model_folder,
        validate_tokenizer_folder,
    )

    try:
        for key, path, tokenizer in (("model.path", cfg.model.path, cfg.model.tokenizer_path is None),
                                     ("critic.model_path", cfg.critic.model_path, False)):
            if path is not None and not path.startswith("builtin:"):
                validate_model_folder(path, key, need_tokenizer=tokenizer)
        tok = cfg.model.tokenizer_path
        if tok is not None and not tok.startswith("builtin:"):
            tokenizer = validate_tokenizer_folder(tok, "model.tokenizer_path")
            if not cfg.model.path.startswith("builtin:"):
                check_vocab(read_config(cfg.model.path, "model.path"), tokenizer, "model.tokenizer_path", tok)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _check_sp_heads(cfg)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    override = cfg.model.max_position_embeddings
    _check(override is None or override >= longest,
           f"model.max_position_embeddings is {override}, fewer than data.max_prompt_length + "
           f"data.max_response_length = {longest} positions a sequence may take")
    if not cfg.model.path.startswith("builtin:"):
        text = text_config(read_config(cfg.model.path, "model.path"))
        if override is not None:
            rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
            kind = rope.get("rope_type", rope.get("type", "default"))
            # dynamic / longrope scale by it; yarn and llama3 fall back to it without their own original
            # length.
            reads = kind in ("dynamic", "longrope") or (
                kind in ("yarn", "llama3") and not rope.get("original_max_position_embeddings"))
            _check(not reads,
                   f"model.max_position_embeddings is set, but model.path {cfg.model.path!r} uses {kind!r} "
                   f"RoPE scaling, whose frequencies depend on it: overriding it would change the model; "
                   f"leave it unset (null) for this model")
        limit = override or text.get("max_position_embeddings")
        _check(limit is None or limit >= longest,
               f"model.path {cfg.model.path!r} has max_position_embeddings {limit}, fewer than "
               f"data.max_prompt_length + data.max_response_length = {longest} positions a sequence may "
               f"take; model.max_position_embeddings raises it")


def _check_lora_ranks(cfg: Config) -> None:
    """A LoRA rank no larger than the narrowest side of a layer it adapts: a wider one adds parameters
    that cannot add rank (B @ A is at most that wide) and only slows the update."""
    from spmdrl.config.shape import ModelShape

    m, c = cfg.model, cfg.critic
    for key, rank, path, targets, exclude in (
            ("model", m.lora_rank, m.path, m.target_modules, m.exclude_modules),
            ("critic", c.lora_rank, c.model_path or m.path, c.target_modules, None)):
        if rank == 0 or (key == "model" and cfg.model.lora_adapter_path is not None):
            continue
        dims = ModelShape.of(path).linear_dims()
        names = [n for n in dims if targets == "all-linear" or n in _names(targets)]
        names = [n for n in names if n not in _names(exclude)]
        if not names:
            continue  # adapters on layers this check does not know (peft checks those)
        side, name = min((min(dims[n]), n) for n in names)
        _check(rank <= side, f"{key}.lora_rank is {rank}, but {name} of {path!r} is {dims[name][0]} x "
                              f"{dims[name][1]}: a LoRA rank can be at most the narrowest side ({side}) of a "
                              f"layer it adapts")


def _names(spec: Union[str, list[str], None]) -> list[str]:
    return [] if spec is None else [spec] if isinstance(spec, str) else list(spec)


def _check_backends(cfg: Config) -> None:
    """Each backend checks its own keys (and that it can run here)."""
    from spmdrl.engines import engine_class
    from spmdrl.rollout import rollout_engine_class

    try:
        rollout_engine_class(cfg.rollout.engine).check_config(cfg)
        engine_class(cfg.actor.strategy).check_config(cfg)
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from err


def _check_inputs(cfg: Config, dims: "ParallelDims") -> None:
    """Data files, the reward function's file, the tool config and the checkpoint to resume from."""
    d, r, t = cfg.data, cfg.rollout, cfg.trainer
    for key in ("train_files", "val_files"):
        for f in _files(getattr(d, key)):
            if f.startswith("builtin:"):
                continue
            what = "is a folder" if Path(f).is_dir() else "does not exist"
            _check(Path(f).is_file(),
                   f"data.{key} names {f!r}, which {what}; give parquet files or builtin:<task>")
    _check(bool(_files(d.train_files)), "data.train_files is empty; give parquet files or builtin:<task>")
    if cfg.reward.function != "builtin":
        path, _, fn = cfg.reward.function.rpartition(":")
        _check(
            bool(path) and bool(fn) and path.endswith(".py"),
            f"reward.function is {cfg.reward.function!r}; it must be 'builtin' or 'path/to/file.py:function'",
        )
        _check(Path(path).is_file(), f"reward.function names the file {path!r}, which does not exist")
    if r.multi_turn.enable:
        from spmdrl.agent.rollout import check_multi_turn_config

        try:
            check_multi_turn_config(cfg, dims)  # imports every tool class: a bad tool config stops here
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if t.resume not in ("auto", "off"):
        from spmdrl.checkpoint.layout import resolve_resume

        # A missing, incomplete (*.tmp, no manifest) or unreadable checkpoint fails here, before any work.
        resolve_resume(t.resume, output_dir(cfg))


def _check_reward_model(cfg: Config) -> None:
    """reward_model.*: a model folder, sizes, weights, and no train TP (the reward engine runs without it)."""
    from spmdrl.config.model_folder import validate_model_folder
    from spmdrl.reward.model import check_weights

    rm = cfg.reward_model
    _check(rm.model.path is not None, "reward_model.enable is true but reward_model.model.path is null; "
                                      "give a Hugging Face sequence-classification model folder")
    _check(rm.micro_batch_size_per_gpu >= 1,
           f"reward_model.micro_batch_size_per_gpu is {rm.micro_batch_size_per_gpu}; it must be an "
           f"integer >= 1")
    _check(rm.max_length is None or rm.max_length >= 1,
           f"reward_model.max_length is {rm.max_length}; it must be >= 1 or null")
    _check(cfg.parallel.tp == 1, f"reward_model.enable with parallel.tp={cfg.parallel.tp}: the reward model "
                                 f"runs without tensor parallelism; set parallel.tp: 1")
    try:
        check_weights(rm.rm_weight, rm.rule_weight)
        if not rm.model.path.startswith("builtin:"):
            validate_model_folder(rm.model.path, "reward_model.model.path", need_tokenizer=True)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if not rm.model.path.startswith("builtin:"):
        from transformers import AutoTokenizer

        from spmdrl.config.model_folder import read_config

        # A causal LM folder would load with a fresh, random score head (a warning only): refuse it here.
        rm_config = read_config(rm.model.path, "reward_model.model.path")
        arch = rm_config.get("architectures") or []
        _check(any(a.endswith("ForSequenceClassification") for a in arch),
               f"reward_model.model.path {rm.model.path!r} holds "
               f"{', '.join(arch) or 'no architectures entry'}; the reward model must be a "
               f"*ForSequenceClassification model with one label")
        # transformers' default without id2label is 2 labels; a score per label is not one reward.
        labels = len(rm_config.get("id2label") or {}) or rm_config.get("num_labels", 2)
        _check(labels == 1, f"reward_model.model.path {rm.model.path!r} has {labels} labels in config.json; "
                            f"the reward model must output one score (num_labels 1)")
        _check(bool(getattr(AutoTokenizer.from_pretrained(rm.model.path), "chat_template", None)),
               f"reward_model.model.path {rm.model.path!r} has a tokenizer without a chat template; the "
               f"reward model scores prompt + response rendered with its own chat template")
