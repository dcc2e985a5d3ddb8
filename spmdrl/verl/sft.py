"""verl's SFT command line (``verl.trainer.fsdp_sft_trainer``) mapped onto ``spmdrl.sft``: one table, one row
per verl key, in the style of ``spmdrl.verl.compat.TABLE``.

    torchrun --nproc-per-node 2 -m spmdrl.sft data.train_files=train.parquet model.partial_pretrain=./qwen ...

``spmdrl.sft.config.parse_sft_config`` hands these rows to ``spmdrl.verl.args.rewrite_argv``; a verl SFT key
with no row stops the run with one sentence naming it (exit 2).
"""

from __future__ import annotations

from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.verl.compat import PERF
from spmdrl.verl.converters import (
    _choice,
    _ckpt_contents,
    _logger,
    _path,
    _per_gpu,
    _strategy,
    _warmup_steps,
)
from spmdrl.verl.rules import Ctx, Rule, ignore, m, only

PLACEMENT = "torchrun decides where ranks run"


def _val_files(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {"data.val_files": _path(value)}  # null: no validation, as in verl


def _warmup_ratio(value: Any, ctx: Ctx) -> dict[str, Any]:
    """verl's fraction of all steps; spmdrl's warm-up is counted in steps, so the total must be known."""
    if not value:
        return {}
    total = ctx.verl.get("trainer.total_training_steps")
    if not isinstance(total, int) or total < 1:
        raise ConfigError(f"verl key optim.warmup_steps_ratio={value!r} needs trainer.total_training_steps "
                          f"(spmdrl counts warm-up in steps); give both, or optim.warmup_steps_ratio=0 and "
                          f"--actor.lr_warmup_steps N")
    return {"actor.lr_warmup_steps": int(value * total)}


def _dtype(value: Any) -> Any:
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    return _choice("model.fsdp_config.model_dtype", names)(value)


def _multiturn_flag(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {"data.multiturn.enable": bool(value)}


SCHEDULES = {"constant": "constant", "cosine": "cosine"}

SFT_TABLE: list[Rule] = [
    # data
    m("data.train_files", "data.train_files", _path, "~ is expanded"),
    Rule("data.val_files", "data.val_files", _val_files, "~ is expanded; null: no validation"),
    m("data.prompt_key", "data.prompt_key"),
    m("data.response_key", "data.response_key"),
    m("data.prompt_dict_keys", "data.prompt_dict_keys"),
    m("data.response_dict_keys", "data.response_dict_keys"),
    Rule("data.multiturn.enable", "data.multiturn.enable", _multiturn_flag),
    m("data.multiturn.messages_key", "data.multiturn.messages_key"),
    m("data.max_length", "data.max_length"),
    m("data.truncation", "data.truncation", _choice("data.truncation", {"error": "error", "left": "left",
                                                                         "right": "right"})),
    m("data.train_batch_size", "data.train_batch_size"),
    m("data.micro_batch_size_per_gpu", "data.micro_batch_size_per_gpu"),
    Rule("data.micro_batch_size", "data.micro_batch_size_per_gpu", _per_gpu("data.micro_batch_size_per_gpu"),
         "deprecated global size, divided by the world size"),
    ignore("data.balance_dp_token", PERF),
    only("data.use_dynamic_bsz", (False,), "micro-batches have a fixed number of rows"),
    ignore("data.max_token_len_per_gpu", "used only with data.use_dynamic_bsz"),
    ignore("data.use_shm", "files are read from local paths"),
    only("data.chat_template", (None,), "the tokenizer's own chat template renders every row"),
    only("data.custom_cls.path", (None,), "rows are read by spmdrl.sft's dataset (verl's SFT layouts)"),
    only("data.custom_cls.name", (None,), "rows are read by spmdrl.sft's dataset (verl's SFT layouts)"),
    # model
    m("model.partial_pretrain", "model.path", _path, "a local Hugging Face folder; ~ is expanded"),
    m("model.strategy", "actor.strategy", _strategy, "fsdp and fsdp2 both mean fsdp2"),
    m("model.enable_gradient_checkpointing", "model.enable_gradient_checkpointing"),
    m("model.use_liger", "model.fused_kernels", lambda v: "on" if v else "off",
      "true: on, false: off (fused RMSNorm/SwiGLU)"),
    m("model.fsdp_config.model_dtype", "model.dtype", _dtype, "fp32/bf16 as float32/bfloat16"),
    m("model.fsdp_config.cpu_offload", "actor.cpu_offload"),
    only("model.fsdp_config.offload_params", (False,),
         "give model.fsdp_config.cpu_offload (FSDP2 CPU offload)"),
    ignore("model.fsdp_config.wrap_policy.*", "FSDP2 wraps each decoder layer"),
    ignore("model.fsdp_config.reshard_after_forward", PERF),
    only("model.external_lib", (None,), "transformers loads the model"),
    only("model.trust_remote_code", (False,), "models load without code from their folder"),
    m("model.lora_rank", "model.lora_rank"),
    m("model.lora_alpha", "model.lora_alpha"),
    m("model.target_modules", "model.target_modules"),
    # optimizer
    m("optim.lr", "actor.lr"),
    m("optim.betas", "actor.betas"),
    m("optim.weight_decay", "actor.weight_decay"),
    m("optim.clip_grad", "actor.max_grad_norm"),
    Rule("optim.warmup_steps_ratio", "actor.lr_warmup_steps", _warmup_ratio,
         "ratio x trainer.total_training_steps (which it needs)"),
    Rule("optim.lr_warmup_steps_ratio", "actor.lr_warmup_steps", _warmup_ratio,
         "ratio x trainer.total_training_steps (which it needs)"),
    m("optim.lr_warmup_steps", "actor.lr_warmup_steps", _warmup_steps, "-1 (use the ratio) sets nothing"),
    m("optim.lr_scheduler", "actor.lr_scheduler", _choice("optim.lr_scheduler", SCHEDULES)),
    m("optim.warmup_style", "actor.lr_scheduler", _choice("optim.warmup_style", SCHEDULES)),
    m("optim.min_lr_ratio", "actor.min_lr_ratio"),
    # parallelism
    only("ulysses_sequence_parallel_size", (1,), "no sequence parallelism yet"),
    ignore("use_remove_padding", PERF),
    # trainer
    m("trainer.default_local_dir", "trainer.output_dir", _path, "checkpoints go to its checkpoints/ folder"),
    m("trainer.project_name", "trainer.project_name"),
    m("trainer.experiment_name", "trainer.experiment_name"),
    m("trainer.total_epochs", "trainer.total_epochs"),
    m("trainer.total_training_steps", "trainer.total_steps"),
    m("trainer.logger", "trainer.logger", _logger,
      "one name or a list; jsonl (metrics.jsonl) is always kept"),
    m("trainer.seed", "trainer.seed"),
    m("trainer.save_freq", "trainer.save_freq"),
    m("trainer.test_freq", "trainer.test_freq"),
    m("trainer.device", "trainer.device"),
    m("trainer.max_ckpt_to_keep", "trainer.keep_last", note="null keeps spmdrl's default"),
    m("trainer.resume_path", "trainer.resume", _path, "a checkpoint folder (global_step_N)"),
    m("trainer.resume_mode", "trainer.resume",
      _choice("trainer.resume_mode", {"auto": "auto", "disable": "off"})),
    only("trainer.default_hdfs_dir", (None,), "write to a shared file system"),
    Rule("trainer.checkpoint.save_contents", "trainer.export_hf_on_save", _ckpt_contents,
         "model, optimizer and extra are always saved; hf_model sets trainer.export_hf_on_save"),
    ignore("trainer.checkpoint.load_contents", "every saved part is loaded"),
    ignore("trainer.nnodes", PLACEMENT),
    ignore("trainer.n_gpus_per_node", PLACEMENT),
]

# verl's SFT defaults where they differ from spmdrl's: they apply to a run given in verl terms without
# --config, so a verl SFT script means what it meant in verl.
SFT_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 256,
    "data.micro_batch_size_per_gpu": 4,
    "data.prompt_key": "question",
    "data.response_key": "answer",
    "data.max_length": 1024,
    "data.truncation": "error",
    "optim.lr": 1e-5,
    "optim.betas": [0.9, 0.95],
    "optim.weight_decay": 0.01,
    "optim.clip_grad": 1.0,
    "optim.lr_scheduler": "cosine",
    "trainer.total_epochs": 4,
}
