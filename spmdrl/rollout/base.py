"""The rollout-engine interface and what it returns.

An engine lives in-process on every rank. Its calls come in this order
(docs/design.md, "Weight sync order"), owned by ``RolloutSession`` alone:

    engine.wake_up(("weights",))
    engine.update_weights(actor.export_weights())   # (hf_name, full tensor) stream, when stale
    engine.wake_up(("kv_cache",))
    out = engine.generate(prompts, sampling)        # any number of calls
    engine.sleep(level)

Backends are looked up by name in ``spmdrl.rollout`` (``rollout_engine_class``),
whose factories import them lazily, so a run with the native engine never
imports another backend; each engine checks its own config keys
(``check_config``) before any work and builds itself (``from_config``).
"""

from __future__ import annotations

import abc
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import torch

from spmdrl.precision import resolve_dtype

T = TypeVar("T")

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.config import Config
    from spmdrl.config.shape import ModelShape


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
    # One 63-bit key per input prompt (``sampling.response_key``): the sampling noise of sample j of prompt i
    # at response position t is a function of (keys[i], j, t) alone, so the same prompt draws the same
    # response whatever the world size, batch or rank that generates it. None: the engine's own stream.
    keys: Optional[tuple[int, ...]] = None
    # Keep each row's KV cache for a next call whose prompt continues that row (multi-turn rollouts), so the
    # next call prefills only the new tokens; engines without it ignore this (the native engine has it).
    keep_prefix: bool = False
    # Return the sampled tokens' log-probs. False lets an engine skip them (vLLM and SGLang do: they cost a
    # good part of a small model's decode step) and return logprobs None; native and hf return them anyway.
    logprobs: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def full_distribution(self) -> bool:
        """No top-k / top-p truncation: the returned log-probs are of the distribution the actor recomputes,
        so the two can be compared (rollout/sampling.py)."""
        return self.top_k <= 0 and self.top_p >= 1.0


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
    # [N, R] float32, log p(token) under the sampling distribution, 0 on padding; None when the call asked
    # for none (SamplingParams.logprobs) and the engine skipped them
    logprobs: Optional[torch.Tensor]
    finish_reasons: list[str] = field(default_factory=list)  # [N] "stop" (EOS/stop token) or "length"
    prompt_index: Optional[torch.Tensor] = None  # [N] int64, which input prompt each row came from
    # [N, R] bool, True on every real response token; None means response_mask. Multi-turn rollouts
    # (spmdrl.agent) attend to tool output inside the response but do not train on it.
    response_attention: Optional[torch.Tensor] = None
    # [N, P+R, L, k] an MoE model's experts of every token in each layer, where the engine records them
    # (batch.py: ``routed_experts``; routing replay R3), else None
    routed_experts: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:  # [N]
        return self.response_mask.sum(-1)

    @classmethod
    def from_samples(cls, prompts: Sequence[Sequence[int]], n: int, max_tokens: int,
                     samples: Sequence[tuple[Sequence[int], Optional[Sequence[float]], str]],
                     pad_token_id: int) -> "GenerationOutput":
        """The output of a library engine's samples, prompt-major (n per prompt): each is (its token ids,
        their log-probs or None when the call asked for none, "stop" or "length")."""
        N, R = len(samples), max_tokens
        response_ids = torch.full((N, R), pad_token_id, dtype=torch.long)
        with_logprobs = all(lp is not None for _, lp, _ in samples)
        logprobs = torch.zeros(N, R, dtype=torch.float32) if with_logprobs else None
        lengths = torch.zeros(N, dtype=torch.long)
        for i, (ids, lp, _) in enumerate(samples):
            lengths[i] = len(ids)
            response_ids[i, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            if logprobs is not None:
                logprobs[i, :len(ids)] = torch.tensor(list(lp[:len(ids)]), dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, torch.device("cpu"))
        idx = torch.arange(len(prompts)).repeat_interleave(n)  # [N]
        mask = torch.arange(R)[None, :] < lengths[:, None]  # [N, R]
        return cls(prompt_ids[idx], prompt_mask[idx], response_ids, mask, logprobs,
                   [reason for *_, reason in samples], idx)

    def select(self, rows: torch.Tensor) -> "GenerationOutput":
        """The rows ``rows`` [M] int64 (prompt_index still refers to the call's input prompts)."""
        return GenerationOutput(
            self.prompt_ids[rows], self.prompt_mask[rows], self.response_ids[rows], self.response_mask[rows],
            None if self.logprobs is None else self.logprobs[rows],
            [self.finish_reasons[i] for i in rows.tolist()],
            None if self.prompt_index is None else self.prompt_index[rows],
            None if self.response_attention is None else self.response_attention[rows],
        )


def left_pad(prompts: Sequence[Sequence[int]], pad: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> ids [P, T] int64 left-padded with ``pad`` and valid [P, T] bool."""
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (T - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)
    return ids, valid


def tp_share(num_prompts: int, tp_rank: int, tp: int) -> range:
    """The input prompts whose responses rank ``tp_rank`` of a rollout TP group keeps: a contiguous 1/tp of
    them (whole prompt groups, so group statistics stay rank-local). Every rank of the group generated all
    of them; concatenated over the group's ranks, the shares are the group's outputs in rollout order.
    When ``tp`` does not divide ``num_prompts`` (validation batches) the first ranks keep one more."""
    base, extra = divmod(num_prompts, tp)
    start = tp_rank * base + min(tp_rank, extra)
    return range(start, start + base + (tp_rank < extra))


def eos_ids_from_folder(model_path: str | Path, tokenizer_eos: Optional[int] = None) -> list[int]:
    """The ids that end a response: the tokenizer's EOS (when given) and the folder's
    generation_config.json EOS, else config.json's (an int or a list in either)."""
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    for fname in ("generation_config.json", "config.json"):
        f = Path(model_path) / fname
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
                break
    return sorted(ids)


# What ``sleep`` frees and ``wake_up`` re-materialises.
SLEEP_TAGS = ("weights", "kv_cache")
# float32 logits, probabilities and (top-p) the sorted copy with its int64 order, per vocabulary entry and
# decoded row: the sampler's temporaries (rollout/sampling.py).
SAMPLING_BYTES = 4 + 4 + 4 + 8


def engine_rows(cfg: "Config", rollout_dp: int) -> int:
    """Rows one engine decodes at once at most: a training or validation call's prompts (its rollout-DP
    share) times their n, capped by rollout.max_num_seqs in whole prompts."""
    r, d = cfg.rollout, cfg.data
    calls = [(d.draw_size, r.n)] + ([(d.val_batch_size, r.val_kwargs.n)] if d.val_files else [])
    return max(min(-(-batch // rollout_dp), max(1, r.max_num_seqs // n)) * n for batch, n in calls)


def sleep_level(cfg: "Config", device_type: str) -> int:
    """rollout.sleep_level, with null resolved for the device: 2 on CPU (level 1 would keep the weights in
    the same memory while training runs, and each wake after an update loads new ones anyway), else 1."""
    if cfg.rollout.sleep_level is not None:
        return cfg.rollout.sleep_level
    return 2 if device_type == "cpu" else 1


# Engines that run one whole model per rank refuse rollout TP with this sentence.
TP_UNSUPPORTED = ("parallel.rollout_tp is {tp} but the native and hf rollout engines run one engine per "
                  "rank; rollout tensor parallelism needs an engine that shards (set parallel.rollout_tp: 1)")


def drop_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
    """Pull a weight stream through, bucket by bucket, keeping none of it: a rollout TP group's rank whose
    leader holds the engine still takes part in the export (a collective). Returns its bytes."""
    sent = 0
    for bucket in buckets(named_tensors, bucket_bytes):
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket[:]
    return sent


def cpu_threads_bind(tp: int) -> str:
    """This process's CPUs cut into ``tp`` contiguous parts, one per TP rank of an engine whose TP ranks are
    processes of its own ("0|1" on 2 cores; a CPU shared when there are fewer CPUs than TP ranks), as
    SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` and vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` take them: both refuse
    to bind more CPU workers than NUMA nodes by themselves."""
    cpus = sorted(os.sched_getaffinity(0))
    parts = [cpus[i * len(cpus) // tp:(i + 1) * len(cpus) // tp] or [cpus[i % len(cpus)]] for i in range(tp)]
    return "|".join(",".join(map(str, p)) for p in parts)


def from_leader(group: Optional["ProcessGroup"], leader: Optional[int], make: Callable[[], T],
                engine: str) -> T:
    """``make()`` on the rollout TP group's leader, which owns the engine, its result broadcast to the
    group (or its error, raised on every rank of the group so that none waits for the others); ``make()``
    alone without a group."""
    if group is None:
        return make()
    box: list = [None]
    if torch.distributed.get_rank() == leader:
        try:
            box[0] = make()
        except Exception as err:  # noqa: BLE001 - raised below, on every rank of the group
            box[0] = f"{type(err).__name__}: {err}"
    torch.distributed.broadcast_object_list(box, src=leader, group=group)
    if isinstance(box[0], str):
        raise RuntimeError(f"{engine} rollout: the TP group's leader (rank {leader}) failed: {box[0]}")
    return box[0]


@dataclass(frozen=True)
class EngineMemory:
    """What a rollout engine holds on one rank, for the memory plan (spmdrl/plan); bytes."""

    weights: float  # awake: its own copy of the policy
    kv_cache: float  # while generating
    temporaries: float  # the largest decode step's (logits and sampling over the vocabulary)
    asleep: float  # what stays while training runs (colocated, rollout.free_cache_engine)
    sync: float  # what a weight update holds beyond the weights (the largest tensor, or a bucket of them)
    repacked: float = 0.0  # a second copy of the weights it decodes from while generating
    kept_kv: float = 0.0  # KV cache it never frees (held while weights load too)
    runtime: float = 0.0  # what the engine adds to the trainer's process (imports, start-up), CPU
    elsewhere: str = ""  # memory held outside this process, said in words (SGLang's scheduler)


class RolloutEngine(abc.ABC):
    """One in-process generation engine per rank (one rollout DP x TP coordinate)."""

    # Whether it runs on split placement's rollout ranks (rollout.placement split, spmdrl/split/): the
    # engine builds on the rollout mesh alone and takes the weights the training ranks send.
    runs_split: bool = False
    # Whether GenerationOutput.routed_experts holds an MoE model's routing (routing replay R3).
    records_routes: bool = False

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
    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Re-materialise what ``tags`` names ("weights", "kv_cache")."""

    def close(self) -> None:
        """Release what the engine started (threads, process groups) at the end of a run; default: nothing."""

    # ---- construction from the run config (each engine validates its own options) ----------------

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        """Raise ValueError (one sentence) when ``cfg`` asks this engine for something it cannot do.

        Runs before any process group or model exists; the default accepts everything.
        """

    @classmethod
    def keyed_sampling(cls, cfg: "Config") -> bool:
        """Whether this engine draws each response from its key (``SamplingParams.keys``) under ``cfg``, so
        samples do not depend on the world size; the native and hf engines always do."""
        return True

    @classmethod
    def memory(cls, cfg: "Config", shape: "ModelShape", device_type: str, rollout_dp: int,
               rollout_tp: int) -> EngineMemory:
        """What this engine holds on one rank (see ``EngineMemory``); runs before any model exists. The
        default is an in-process engine with its own copy of the weights in rollout.dtype and a KV cache
        for its largest chunk of rows (at most rollout.max_num_seqs), the full prompt and response long;
        level 1 sleep keeps the weights (off the device, which on CPU is the same memory), level 2 frees
        them."""
        b = torch.finfo(resolve_dtype(cfg.rollout.dtype, device_type)).bits // 8
        rows = engine_rows(cfg, rollout_dp)
        seq = cfg.data.max_prompt_length + cfg.data.max_response_length
        weights = shape.params * b / rollout_tp
        kv = rows * seq * shape.kv_bytes_per_token(b) / rollout_tp
        kept = weights if sleep_level(cfg, device_type) == 1 and device_type == "cpu" else 0.0
        asleep = kept if cfg.trainer.sleep_rollout and cfg.rollout.free_cache_engine else weights + kv
        return EngineMemory(weights=weights, kv_cache=kv, temporaries=rows * shape.vocab * SAMPLING_BYTES,
                            asleep=asleep, sync=shape.vocab * shape.hidden * b / rollout_tp)

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: "Config", model_path: str, *, mesh: Optional["DeviceMesh"],
                    device: torch.device, eos_token_ids: Sequence[int], pad_token_id: int) -> "RolloutEngine":
        """Build this rank's engine from the run config (``model_path`` already resolved from
        ``builtin:``)."""


def common_kwargs(cfg: "Config", device: torch.device) -> dict:
    """Constructor arguments every in-process engine takes from the config: the resolved dtype
    (``auto`` decided for ``device``), ``max_num_seqs`` and the base sampling seed (engines add their DP
    rank)."""
    r = cfg.rollout
    return dict(dtype=resolve_dtype(r.dtype, device.type), max_num_seqs=r.max_num_seqs,
                seed=cfg.trainer.seed * 1000)


@dataclass
class LibraryOptions:
    """What the library engines (vLLM, SGLang) take from the run config; each adds its own keys."""

    dtype: torch.dtype = torch.float32
    max_num_seqs: int = 256  # most sequences the library runs at once
    seed: int = 0  # sampling starts from seed + rollout-DP rank
    max_model_len: int = 2048  # longest prompt + response
    gpu_memory_utilization: float = 0.5  # CUDA only
    bucket_bytes: int = 512 << 20  # most exported bytes alive at once during update_weights
    max_position_embeddings: Optional[int] = None  # model.max_position_embeddings: config.json's, overridden

    @classmethod
    def from_config(cls, cfg: "Config", device: torch.device, **own):
        r, d = cfg.rollout, cfg.data
        return cls(**common_kwargs(cfg, device),
                   max_model_len=r.max_model_len or d.max_prompt_length + d.max_response_length,
                   gpu_memory_utilization=r.gpu_memory_utilization,
                   bucket_bytes=r.update_weights_bucket_megabytes << 20,
                   max_position_embeddings=cfg.model.max_position_embeddings, **own)


def library_missing(module: str, name: str) -> Optional[str]:
    """None when ``module`` can be imported here, else why not (one sentence naming ``name``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:  # origin None: a namespace package (a stray folder)
        return f"{name} is not installed in this Python environment"
    return None


def check_sleep_level(level: int) -> None:
    """Level 1 keeps the weights (off the device where there is one); level 2 drops them."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")


def check_wake_tags(tags: Sequence[str]) -> None:
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad:
        raise ValueError(f"wake_up tags {bad} are not valid; valid tags: {', '.join(SLEEP_TAGS)}")


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into lists of about ``bucket_bytes`` (a tensor larger than that is a
    bucket of its own); the next bucket is pulled only after the previous one was handed on."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
