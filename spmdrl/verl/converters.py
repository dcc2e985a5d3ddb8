"""Value converters of verl's keys, shared by the RL table (``spmdrl.verl.compat``) and the SFT table
(``spmdrl.verl.sft``): each takes a verl value (and, for a ``Rule``'s convert, the ``Ctx``) and returns
spmdrl's value or keys, or raises ConfigError with one sentence."""

from __future__ import annotations

import os.path
from typing import Any, Callable

from spmdrl.errors import ConfigError
from spmdrl.verl.rules import SKIP, Ctx, Rule, ignore, m, only

AR = "actor_rollout_ref"
ACT = f"{AR}.actor"


def _choice(key: str, mapping: dict[Any, Any]) -> Callable[[Any], Any]:
    def conv(value: Any) -> Any:
        if value not in mapping:
            valid = ", ".join(repr(k) for k in mapping)
            raise ConfigError(f"verl key {key}={value!r} has no spmdrl equivalent; valid values: {valid}")
        return mapping[value]

    return conv


def _logger(value: Any) -> Any:
    # verl takes one name or a list; spmdrl always keeps metrics.jsonl (resume and spmdrl.plot read it).
    names = [value] if isinstance(value, str) else list(value or [])
    others = [n for n in names if n not in ("console", "jsonl")]
    return (["console"] if "console" in names else []) + ["jsonl"] + others


def _path(value: Any) -> Any:
    # verl expands ~ in its paths itself (Hydra does not, nor does the shell after "key="): so does spmdrl.
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return os.path.expanduser(value) if isinstance(value, str) else value


def _strategy(value: Any) -> Any:
    return "fsdp2" if value in ("fsdp", "fsdp2") else value


def _same_strategy(key: str, only_if: str = "") -> Callable[[Any, Ctx], dict[str, Any]]:
    """ref / critic / reward_model strategy: spmdrl builds every role with actor.strategy, so a verl
    strategy must name the actor's (fsdp and fsdp2 alike); ``only_if``: checked only when that verl key is
    true (a disabled reward model's strategy changes nothing)."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        actor = _strategy(ctx.verl.get(f"{ACT}.strategy", "fsdp"))
        if value is None or (only_if and not ctx.verl.get(only_if)) or _strategy(value) == actor:
            return {}
        raise ConfigError(f"verl key {key}={value!r} differs from {ACT}.strategy={actor!r}: spmdrl builds "
                          f"every model with actor.strategy; give {key}={actor!r} or leave it out")

    return convert


def _same_megatron(key: str, field: str) -> Callable[[Any, Ctx], dict[str, Any]]:
    """The reference's / critic's megatron.{tensor,pipeline}_model_parallel_size: Megatron keeps one set of
    TP/PP process groups per process, built from the actor's sizes, so another role's size must equal it."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        actor = ctx.verl.get(f"{ACT}.megatron.{field}", 1)
        if value is None or value == actor:
            return {}
        raise ConfigError(f"verl key {key}={value!r} differs from {ACT}.megatron.{field}={actor!r}: the "
                          f"reference and critic share the actor's Megatron TP/PP groups; give the same size "
                          f"or leave it out")

    return convert


def _megatron_rows(prefix: str) -> list["Rule"]:
    """verl's McoreEngineConfig keys under ``prefix`` (the actor's, reference's or critic's ``megatron``)."""
    rows = [
        only(f"{prefix}.sequence_parallel", (False,),
             "spmdrl's Megatron engine keeps whole sequences on every TP rank: it does not all-reduce the "
             "sequence-parallel norm gradients over TP, so it runs without sequence parallelism (same "
             "results)"),
        only(f"{prefix}.use_distributed_optimizer", (False,),
             "spmdrl steps torch AdamW on each rank's TP/PP shard after one all-reduce of the gradients over "
             "the data-parallel group; Megatron's DDP and distributed optimizer (CUDA-only gradient buffers) "
             "are not used"),
        only(f"{prefix}.virtual_pipeline_model_parallel_size", (None, 1),
             "no interleaved pipeline schedule (1F1B)"),
        only(f"{prefix}.context_parallel_size", (1,),
             "megatron-core's context parallelism needs Transformer Engine's attention, which is not "
             "installed; sequence parallelism is the FSDP2 engine's Ulysses (ulysses_sequence_parallel_"
             "size)"),
        *([m(f"{prefix}.expert_model_parallel_size", "parallel.ep",
             note="expert parallelism of an MoE model, on the fsdp2 engine")]
          if prefix == f"{ACT}.megatron" else
          [ignore(f"{prefix}.expert_model_parallel_size",
                  "parallel.ep (the actor's key) covers every model")]),
        only(f"{prefix}.expert_tensor_parallel_size", (None, 1),
             "no expert or tensor parallelism for MoE yet"),
        only(f"{prefix}.param_offload", (False,), "the Megatron engine keeps its parameters on the device"),
        *([m(f"{prefix}.optimizer_offload", "trainer.offload", _offload, OFFLOAD_NOTE)]
          if prefix == f"{ACT}.megatron" else
          [ignore(f"{prefix}.optimizer_offload", "trainer.offload (the actor's key) covers every model")]),
        ignore(f"{prefix}.grad_offload", GRADS_FREED),
        only(f"{prefix}.use_dist_checkpointing", (False,),
             "checkpoints are torch.distributed.checkpoint folders"),
        only(f"{prefix}.dist_checkpointing_path", (None,),
             "checkpoints are torch.distributed.checkpoint folders"),
        ignore(f"{prefix}.dist_checkpointing_prefix", "used only with use_dist_checkpointing"),
        ignore(f"{prefix}.use_mbridge", "spmdrl converts HF <-> Megatron weights itself (the same tensors)"),
        ignore(f"{prefix}.seed", "Megatron's RNG tracker takes trainer.seed; the models have no dropout"),
    ]
    if prefix != f"{ACT}.megatron":
        rows += [Rule(f"{prefix}.{f}", "", _same_megatron(f"{prefix}.{f}", f), "must equal the actor's")
                 for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]
    return rows


def _top_k(value: Any) -> Any:
    return -1 if value in (0, -1) else value  # verl's hf rollout writes 0 for "no top-k", vLLM -1


def _per_gpu(spmdrl: str) -> Callable[[Any, Ctx], dict[str, Any]]:
    """verl's deprecated global micro-batch keys: verl divides them by the number of ranks."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        return {} if value is None else {spmdrl: max(1, int(value) // ctx.world_size)}

    return convert


def _rollout_ranks(verl: dict[str, Any]) -> int:
    """The ranks that only generate: without the hybrid engine, verl's rollout.* nodes and GPUs."""
    split = verl.get("actor_rollout_ref.hybrid_engine") is False
    return verl.get("rollout.n_gpus_per_node", 0) * verl.get("rollout.nnodes", 1) if split else 0


def _fsdp_size(value: Any, ctx: Ctx) -> dict[str, Any]:
    # verl's fsdp_size k shards over groups of k ranks and replicates over the rest: spmdrl's HSDP. The
    # ranks are the training ones (split placement's rollout ranks hold no model to shard). Under Ulysses a
    # group of k is k / sp data-parallel shards times sp (FSDP shards over dp x sp).
    train, sp = ctx.world_size - _rollout_ranks(ctx.verl), _actor_sp(ctx)
    if value in (None, -1) or value == train:
        return {}
    k = int(value)
    if k <= 0 or train % k or k % sp:
        raise ConfigError(f"verl key actor_rollout_ref.actor.fsdp_config.fsdp_size={value} does not divide "
                          f"the {train} training ranks or is not a multiple of the ulysses_sequence_parallel_"
                          f"size {sp}; give -1 or such a divisor of their number")
    return {"parallel.dp_shard": k // sp, "parallel.dp_replicate": train // k}


# verl's two names of the actor's Ulysses degree (the older one directly under the actor).
SP_KEYS = (f"{ACT}.ulysses_sequence_parallel_size", f"{ACT}.fsdp_config.ulysses_sequence_parallel_size")


def _actor_sp(ctx: Ctx) -> int:
    """The actor's ulysses_sequence_parallel_size under either name (1 when neither is given)."""
    given = {k: ctx.verl[k] for k in SP_KEYS if ctx.verl.get(k) is not None}
    if len({int(v) for v in given.values()}) > 1:
        raise ConfigError(f"verl keys {SP_KEYS[0]}={given[SP_KEYS[0]]} and {SP_KEYS[1]}={given[SP_KEYS[1]]} "
                          f"differ; they name one setting: give one of them")
    return int(next(iter(given.values()), 1))


def _sp(value: Any, ctx: Ctx) -> dict[str, Any]:
    """The actor's Ulysses degree: parallel.sp, the one SP degree of the training mesh."""
    return {} if value is None else {"parallel.sp": _actor_sp(ctx)}


def _same_sp(key: str, only_if: str = "") -> Callable[[Any, Ctx], dict[str, Any]]:
    """ref / critic / reward model Ulysses degree: spmdrl runs every model on the one training mesh, so it
    must be the actor's; ``only_if``: checked only when that verl key is true."""

    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        sp = _actor_sp(ctx)
        if value is None or (only_if and not ctx.verl.get(only_if)) or int(value) == sp:
            return {}
        raise ConfigError(f"verl key {key}={value!r} differs from the actor's ulysses_sequence_parallel_size "
                          f"{sp}: spmdrl runs every model on one training mesh with parallel.sp; give "
                          f"{key}={sp} or leave it out")

    return convert


def _clip_ratio(value: Any, ctx: Ctx) -> dict[str, Any]:
    # verl's clip_ratio is the default of both sides; explicit clip_ratio_low/high (later rows, or a
    # --config file) win.
    sides = [k for k in ("actor.clip_ratio_low", "actor.clip_ratio_high") if k not in ctx.given]
    return {} if value is None else {k: value for k in sides}


def _filter_overlong(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {"data.truncation": "filter"} if value else {}


def _resume_mode(value: Any, ctx: Ctx) -> dict[str, Any]:
    if value == "resume_path":
        path = ctx.verl.get("trainer.resume_from_path")
        if not path:
            raise ConfigError("verl key trainer.resume_mode=resume_path needs trainer.resume_from_path")
        return {"trainer.resume": _path(str(path))}
    return {"trainer.resume": _choice("trainer.resume_mode", {"auto": "auto", "disable": "off"})(value)}


def _resume_from_path(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {}  # read by trainer.resume_mode=resume_path, as in verl


def _custom_reward(value: Any, ctx: Ctx) -> dict[str, Any]:
    if value is None:
        return {}
    name = ctx.verl.get("custom_reward_function.name") or "compute_score"
    return {"reward.function": f"{_path(value)}:{name}"}


def _ckpt_contents(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {"trainer.export_hf_on_save": "hf_model" in (value or [])}


def _world(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {}  # checked as a pair in check_world_size


def _multi_turn_format(value: Any) -> Any:
    return _choice("actor_rollout_ref.rollout.multi_turn.format",
                   {"hermes": "hermes", "chatml": "hermes"})(value)


def _offload(value: Any) -> Any:
    return "always" if value else "never"


OFFLOAD_NOTE = "true: always, false: never (spmdrl's default, auto, offloads when the memory plan needs it)"
GRADS_FREED = "gradients are freed after every optimizer step, so nothing holds them while rollout runs"


def _warmup_steps(value: Any) -> Any:
    return SKIP if value is None or value < 0 else value  # verl: negative means "use lr_warmup_steps_ratio"
