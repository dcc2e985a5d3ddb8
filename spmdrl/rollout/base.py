"""The rollout-engine interface and what it returns.

An engine lives in-process on every rank. The loop uses exactly four calls, in
this order each step (see ../../DESIGN.md, "Weight sync order"):

    engine.wake_up(("weights",))
    engine.update_weights(actor.export_weights())   # (hf_name, full tensor) stream
    engine.wake_up(("kv_cache",))
    out = engine.generate(prompts, sampling)
    engine.sleep(level)

Backends are looked up by name and imported lazily (``build_rollout``), so a run
with the native engine never imports vLLM or SGLang.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class SamplingParams:
    """How to sample; one instance per ``generate`` call."""

    n: int = 1  # responses per prompt; the n copies share the prompt's prefill
    max_tokens: int = 16  # new tokens per response
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 keeps every token
    stop_token_ids: Sequence[int] = ()  # besides the tokenizer's EOS ids
    ignore_eos: bool = False  # keep generating past EOS (stop_token_ids still stop), as vLLM's ignore_eos
    seed: Optional[int] = None  # reseeds the engine's generator for this call when set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationOutput:
    """Responses of one ``generate`` call, one row per sample.

    Rows are ordered prompt-major: the n samples of prompt i are rows
    ``i*n .. i*n+n-1``. Prompts are left-padded and responses right-padded with
    ``pad_token_id`` so that ``torch.cat([prompt_ids, response_ids], 1)`` is the
    full sequence the actor scores.
    """

    prompt_ids: torch.Tensor  # [N, P] int64, left-padded
    prompt_mask: torch.Tensor  # [N, P] bool, True on real prompt tokens
    response_ids: torch.Tensor  # [N, R] int64, right-padded (R = max_tokens)
    response_mask: torch.Tensor  # [N, R] bool, True on generated tokens (EOS/stop token included)
    logprobs: torch.Tensor  # [N, R] float32, log p(token) under the sampling distribution, 0 on padding
    finish_reasons: list[str] = field(default_factory=list)  # [N] "stop" (EOS/stop token) or "length"
    prompt_index: Optional[torch.Tensor] = None  # [N] int64, which input prompt each row came from

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:  # [N]
        return self.response_mask.sum(-1)


class RolloutEngine(abc.ABC):
    """One in-process generation engine per rank (one rollout DP x TP coordinate)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample ``sampling.n`` responses for each prompt (token ids, no padding)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trained weights in, one (hf_name, full tensor) at a time."""

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 also moves weights off the device, level 2 frees them."""

    @abc.abstractmethod
    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-materialise what ``tags`` names ("weights", "kv_cache")."""


# name -> "module:Class"; imported only when chosen.
ROLLOUT_ENGINES: dict[str, str] = {
    "native": "spmdrl.rollout.native:NativeRollout",
    "hf": "spmdrl.rollout.hf:HFRollout",
    "vllm": "spmdrl.rollout.vllm:VLLMRollout",
    "sglang": "spmdrl.rollout.sglang:SGLangRollout",
}


def rollout_engine_class(name: str) -> type[RolloutEngine]:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid engines: {', '.join(sorted(ROLLOUT_ENGINES))}")
    module, cls = ROLLOUT_ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_rollout(
    name: str,
    model_path: str,
    *,
    mesh: Optional["DeviceMesh"] = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_num_seqs: int = 256,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    **kwargs,
) -> RolloutEngine:
    """Construct the engine called ``name`` with the common constructor arguments."""
    return rollout_engine_class(name)(
        model_path,
        mesh=mesh,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        seed=seed,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        **kwargs,
    )
