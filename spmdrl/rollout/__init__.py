"""Rollout engines, built by name so a run only imports the backend it uses.

    from spmdrl.rollout import rollout_engine_class
    engine = rollout_engine_class(cfg.rollout.engine).from_config(cfg, model_path, mesh=..., device=..., ...)

``native`` (``spmdrl.rollout.native``: pure torch, the default), ``hf``
(transformers ``generate``, a baseline), ``vllm`` (vLLM in this process, or in
processes of its own on split placement: ``spmdrl.rollout.vllm``) and ``sglang``
(one SGLang engine per rank, its scheduler in child processes). The
interface is ``spmdrl.rollout.base``; ``spmdrl.rollout.session`` owns the order
of its calls.
"""

from __future__ import annotations

from typing import Callable

from spmdrl.rollout.base import RolloutEngine


def _native() -> type[RolloutEngine]:
    from spmdrl.rollout.native.engine import NativeRollout

    return NativeRollout


def _hf() -> type[RolloutEngine]:
    from spmdrl.rollout.hf import HFRollout

    return HFRollout


def _vllm() -> type[RolloutEngine]:
    # The in-process engine, whose from_config and memory follow rollout.placement (VLLMOwnProcessRollout
    # on split placement's rollout ranks).
    from spmdrl.rollout.vllm import VLLMRollout

    return VLLMRollout


def _sglang() -> type[RolloutEngine]:
    from spmdrl.rollout.sglang import SGLangRollout

    return SGLangRollout


# name -> factory returning the class; a backend's module is imported only when chosen.
ROLLOUT_ENGINES: dict[str, Callable[[], type[RolloutEngine]]] = {
    "native": _native, "hf": _hf, "vllm": _vllm, "sglang": _sglang,
}


def rollout_engine_class(name: str) -> type[RolloutEngine]:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout.engine is {name!r}; valid engines: {', '.join(sorted(ROLLOUT_ENGINES))}")
    return ROLLOUT_ENGINES[name]()


def build_rollout(name: str, model_path: str, **kwargs) -> RolloutEngine:
    """Construct the engine called ``name`` directly (tests, benchmarks); the loop uses ``from_config``."""
    return rollout_engine_class(name)(model_path, **kwargs)
