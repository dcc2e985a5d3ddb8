"""The plan's decisions, each with the one line that says why (see ``spmdrl.plan``).

    offload, checkpointing, kv_fraction, lines = decide(cfg, phases, budget, "cuda", engine, total, 0.1, 0.9)

``phases(offload, checkpointing)`` gives the step's phases for a choice; a decision the config makes
(``always`` / ``never``, true / false, a number) is kept and said as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from spmdrl.plan.estimate import GB

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.rollout.base import EngineMemory

Phases = Callable[[bool, bool], dict[str, dict[str, float]]]


def _peak(phase: dict[str, float]) -> float:
    return sum(phase.values())


def decide(cfg: "Config", phases: Phases, budget: float, device_type: str, engine: "EngineMemory",
           total: float, margin: float, max_fraction: float) -> tuple[bool, bool, Optional[float], list[str]]:
    """(offload, activation checkpointing, gpu_memory_utilization or None, the lines that say why)."""
    limit = budget * (1 - margin)
    lines = []
    held = phases(False, False)
    if "update" not in held:  # a split placement's rollout rank: nothing is trained there
        lines.append("split placement's rollout ranks: the rollout engine alone (no model trained, no "
                     "optimizer state to move)")
        busiest = max(held.values(), key=_beside_engine)  # loading weights: the received ones beside it
        return False, False, _kv_fraction(cfg, busiest, engine, device_type, total, margin, max_fraction,
                                          lines, "the received weights leave free while they load"), lines
    ckpt_key = cfg.model.enable_gradient_checkpointing
    checkpointing = ckpt_key is True
    if ckpt_key == "auto":
        update = _peak(held["update"])
        checkpointing = update > limit and _peak(phases(False, True)["update"]) < update
        lines.append(f"activation checkpointing {'on' if checkpointing else 'off'}: the update needs "
                     f"{update / GB:.2f} GB without it, {limit / GB:.2f} GB fit")
    else:
        lines.append(f"activation checkpointing {'on' if checkpointing else 'off'}: "
                     f"model.enable_gradient_checkpointing is {ckpt_key}")
    offload = cfg.trainer.offload == "always"
    if "rollout" not in held:  # a split placement's training rank
        lines.append(f"offload off: split placement's training ranks run no rollout to make room for "
                     f"(trainer.offload {cfg.trainer.offload})")
        return False, checkpointing, None, lines
    if cfg.trainer.offload == "auto":
        rollout = _peak(phases(False, checkpointing)["rollout"])
        if device_type == "cpu":
            lines.append("offload off: on CPU the device is the host, so moving the optimizer state moves "
                         "nothing")
        else:
            offload = rollout > limit
            lines.append(f"offload {'on' if offload else 'off'}: rollout needs {rollout / GB:.2f} GB with "
                         f"the optimizer state resident, {limit / GB:.2f} GB fit")
    else:
        lines.append(f"offload {'on' if offload else 'off'}: trainer.offload is {cfg.trainer.offload}")
    if cfg.trainer.sleep_rollout and cfg.rollout.free_cache_engine:
        lines.append(_sleep_line(cfg, device_type))
    kv_fraction = _kv_fraction(cfg, phases(offload, checkpointing)["rollout"], engine, device_type, total,
                               margin, max_fraction, lines)
    return offload, checkpointing, kv_fraction, lines


def _beside_engine(phase: dict[str, float]) -> float:
    """What a phase holds besides the rollout engine's own memory."""
    return sum(v for k, v in phase.items() if not k.startswith("engine "))


def _sleep_line(cfg: "Config", device_type: str) -> str:
    from spmdrl.rollout.base import sleep_level

    level = sleep_level(cfg, device_type)
    if cfg.rollout.sleep_level is not None:
        return f"rollout sleep level {level}: rollout.sleep_level is {level}"
    if device_type == "cpu":
        return (f"rollout sleep level {level}: on CPU level 1 would keep the engine's weights in the same "
                "memory while training runs, and the next rollout loads the trained weights anyway")
    return f"rollout sleep level {level}: the engine's weights wait in host memory while training runs"


def _kv_fraction(cfg: "Config", rollout: dict[str, float], engine: "EngineMemory", device_type: str,
                 total: float, margin: float, max_fraction: float, lines: list[str],
                 beside: str = "training leaves free while rollout runs") -> Optional[float]:
    """vLLM's gpu_memory_utilization (SGLang's mem_fraction_static): the device share that the rest of
    ``rollout`` (a phase: what it holds besides the engine) leaves free; ``beside`` says what that is."""
    given = cfg.rollout.gpu_memory_utilization
    if cfg.rollout.engine not in ("vllm", "sglang"):
        return None
    if given is not None:
        lines.append(f"rollout engine memory: gpu_memory_utilization {given} as configured")
        return given
    if device_type != "cuda":
        lines.append("rollout engine memory: on CPU the engine's KV cache is sized from rollout.max_num_seqs "
                     "x the longest prompt + response")
        return None
    others = _beside_engine(rollout)
    fraction = min(max_fraction, (total * (1 - margin) - others) / total)
    need = (engine.weights + engine.temporaries) / total
    lines.append(f"rollout engine memory: gpu_memory_utilization {fraction:.2f}, what {beside} "
                 f"({others / GB:.1f} GB of {total / GB:.1f} GB held by it)")
    return round(max(fraction, need), 3)
