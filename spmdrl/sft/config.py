"""Typed configuration of an SFT run, its command line and the checks that run before any work.

The sections ``model``, ``parallel``, ``actor`` (engine and optimizer) and ``trainer`` are the RL run's
own (``spmdrl.config.sections``), so a key means the same in both; only ``data`` is SFT's. RL-only keys of
those sections (``actor.ppo_epochs``, ``trainer.sleep_rollout``, ...) are refused when set. verl's SFT command
line (``verl.trainer.fsdp_sft_trainer`` keys) is rewritten through ``spmdrl.verl.sft.SFT_TABLE``.

    cfg, debug = parse_sft_config(argv)        # ConfigError (one sentence) on bad input
    check_sft_config(cfg, world_size)
    engine_cfg = engine_config(cfg)            # the RL Config the engines are built from
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional, Sequence, Union

from spmdrl.config.sections import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    TrainerConfig,
)
from spmdrl.errors import ConfigError


@dataclass
class SFTMultiTurnConfig:
    """Chat conversations in one column (verl's data.multiturn)."""

    enable: bool = False
    """Read data.multiturn.messages_key instead of prompt/response columns; the loss covers assistant turns
    only (system, user and tool turns are context)."""
    messages_key: str = "messages"
    """Column holding each row's list of {role, content} messages."""


@dataclass
class SFTDataConfig:
    train_files: Union[str, list[str]] = "builtin:arith_sft"
    """Parquet file(s) in verl's SFT layout, or ``builtin:<task>`` (generated on first use in the cache)."""
    val_files: Union[str, list[str], None] = "builtin:arith_sft"
    """Validation parquet file(s) for val/loss, ``builtin:<task>``, or null for no validation."""
    prompt_key: str = "prompt"
    """Column of the prompt: a string (one user turn) or a list of chat messages."""
    response_key: str = "response"
    """Column of the response string (the tokenizer's EOS is appended, as verl does)."""
    prompt_dict_keys: Optional[list[str]] = None
    """Keys to walk down when the prompt column holds (nested) dicts: ['question'] reads
    row[prompt_key]['question']."""
    response_dict_keys: Optional[list[str]] = None
    """Keys to walk down when the response column holds (nested) dicts."""
    multiturn: SFTMultiTurnConfig = field(default_factory=lambda: SFTMultiTurnConfig())
    max_length: int = 1024
    """Most tokens of one rendered row (prompt + response, or the whole conversation)."""
    truncation: Literal["error", "left", "right"] = "error"
    """A row over max_length: stop naming it, keep its last tokens (left) or its first (right)."""
    train_batch_size: int = 256
    """Rows per optimizer step over the whole world."""
    micro_batch_size_per_gpu: int = 4
    """Rows per forward/backward on one rank (gradient accumulation makes up the batch; also the
    validation batch per rank)."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by trainer.seed and the epoch)."""


def _sft_trainer() -> TrainerConfig:
    return TrainerConfig(experiment_name="sft_tiny")


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=_sft_trainer)


# The keys of the shared sections an SFT run reads; every other one belongs to RL and is refused when set.
USED = {
    "actor": {"strategy", "lr", "weight_decay", "betas", "lr_warmup_steps", "lr_scheduler", "min_lr_ratio",
              "max_grad_norm", "param_dtype", "reduce_dtype", "cpu_offload"},
    "parallel": {"dp_shard", "dp_replicate", "tp", "pp"},
    "trainer": {"project_name", "experiment_name", "output_dir", "total_epochs", "total_steps", "seed",
                "device", "logger", "save_freq", "keep_last", "resume", "export_hf_on_save", "test_freq",
                "val_before_train", "progress_bar", "val_only", "plot_freq"},
}


def build_sft_parser():
    from spmdrl.config.parse import build_parser

    return build_parser(
        SFTConfig, prog="torchrun -m spmdrl.sft",
        description="spmdrl.sft: supervised fine-tuning on the RL run's engines. verl's fsdp_sft_trainer "
        "key=value words and --verl-config FILE are accepted too and mapped onto these keys (docs/verl.md).",
        example="configs/sft.yaml")


def parse_sft_config(argv: Optional[Sequence[str]] = None) -> tuple[SFTConfig, bool]:
    """argv (spmdrl keys, or verl's SFT words) -> (config, debug). Raises ConfigError on bad input."""
    import sys

    import jsonargparse

    from spmdrl.config.parse import _one_sentence, rename_keys
    from spmdrl.verl.args import annotate, rewrite_argv
    from spmdrl.verl.sft import SFT_DEFAULTS, SFT_TABLE

    parser = build_sft_parser()
    # A renamed RL key is refused under its new name (check_sft_config), not as an unknown word.
    words = rename_keys(list(argv) if argv is not None else sys.argv[1:])
    argv, origin = rewrite_argv(words, table=SFT_TABLE, defaults=SFT_DEFAULTS, config_cls=SFTConfig,
                                prog="spmdrl.sft")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as err:
        raise ConfigError(annotate(_one_sentence(err), origin)) from err
    debug = bool(ns.pop("debug", False))
    ns.pop("config", None)
    ns = parser.instantiate(ns)
    return SFTConfig(**{k: ns[k] for k in asdict(SFTConfig()).keys()}), debug


def check_sft_config(cfg: SFTConfig, world_size: int) -> None:
    """Ranges, sizes and RL-only keys, before any process group exists (ConfigError, one sentence)."""
    from spmdrl.engines import engine_class

    for section, used in USED.items():
        mine, default = asdict(getattr(cfg, section)), asdict(getattr(SFTConfig(), section))
        for key in sorted(set(mine) - used):
            if mine[key] != default[key]:
                raise ConfigError(f"{section}.{key}={mine[key]!r} is an RL key that spmdrl.sft does not use; "
                                  f"remove it (spmdrl.sft reads {section}.{', '.join(sorted(used))})")
    d = cfg.data
    for key in ("train_batch_size", "micro_batch_size_per_gpu", "max_length"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key} must be at least 1, got {getattr(d, key)}")
    if d.train_batch_size % world_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be a multiple of the world size "
                          f"{world_size}")
    if cfg.trainer.total_steps is not None and cfg.trainer.total_steps < 1:
        raise ConfigError(f"trainer.total_steps must be at least 1 or null, got {cfg.trainer.total_steps}")
    if cfg.actor.lr <= 0:
        raise ConfigError(f"actor.lr must be positive, got {cfg.actor.lr}")
    if cfg.trainer.val_only and not cfg.data.val_files:
        raise ConfigError("trainer.val_only is true but data.val_files is null; validation-only needs "
                          "validation files")
    try:
        engine_class(cfg.actor.strategy).check_config(engine_config(cfg))
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from err


def engine_config(cfg: SFTConfig) -> Config:
    """The RL ``Config`` the engines are built from: SFT's sections, log-probs at temperature 1 and the
    attention kernel chosen for rows of data.max_length tokens."""
    return Config(
        model=cfg.model, parallel=cfg.parallel, actor=cfg.actor, trainer=cfg.trainer,
        data=DataConfig(max_prompt_length=1, max_response_length=max(1, cfg.data.max_length - 1)),
        rollout=RolloutConfig(temperature=1.0),
    )


def resolve_sft_builtins(cfg: SFTConfig) -> SFTConfig:
    """A copy of ``cfg`` whose ``builtin:`` model and data paths name cached folders and files (built on first
    use; collective: call on every rank)."""
    from spmdrl.builtin.models import resolve_builtin_model
    from spmdrl.builtin.tasks import resolve_builtin_data

    def files(value, split):
        if value is None:
            return None
        return [resolve_builtin_data(f, split) for f in ([value] if isinstance(value, str) else value)]

    m = cfg.model
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            m, path=resolve_builtin_model(m.path),
            tokenizer_path=m.tokenizer_path and resolve_builtin_model(m.tokenizer_path)),
        data=dataclasses.replace(cfg.data, train_files=files(cfg.data.train_files, "train"),
                                 val_files=files(cfg.data.val_files, "val")),
    )
