"""The SGLang rollout engine: one ``sglang.Engine`` per rank (per rollout-TP group leader), driven by the
rank's loop (no Ray, no server).

    rollout:
      engine: sglang
    parallel:
      rollout_tp: 2      # one SGLang engine of TP 2 per group of contiguous ranks [0, 1], [2, 3], ...

SGLang always runs its scheduler and detokenizer in child processes (no release has an in-process mode
like vLLM's external launcher), so each rank owns one engine and its children, as verl and slime drive
it; the trainer's process groups never see them. With rollout TP > 1 only the first rank of each rollout
TP group (its leader) starts an engine, of SGLang TP size tp (one scheduler process per TP rank, their
own process group); the leader generates the group's prompts and broadcasts the outputs over the group,
from which ``RolloutSession.generate`` keeps each rank's share, and every rank of the group pulls the
actor's weight export (a collective) while only the leader pushes it.

Prompts go in as token ids (``skip_tokenizer_init``), on CPU with SGLang's ``torch_native`` attention and
``pytorch`` sampling. Different rollout-DP ranks draw from different seeds (``random_seed = seed +
rollout-DP rank``); SGLang ignores per-request seeds unless its deterministic inference is on, so
``SamplingParams.seed`` does not reseed a call here. ``rollout.seed_mode: per_response`` turns that
inference on (CUDA only: SGLang allows it with GPU attention backends, here triton) and seeds every
response from its key (``SamplingParams.keys``), one request per response.

Start-up traps handled by ``_engine_start_env``: under torchrun the children would inherit
``TORCHELASTIC_USE_AGENT_STORE`` (and the rest of torchrun's rendezvous variables) and hang for ever in
their own process-group set-up, so those are hidden while the engine starts; at TP > 1 on CPU SGLang
asserts (and kills this process) unless ``SGLANG_CPU_OMP_THREADS_BIND`` names each TP rank's cores, so
it is set from this process's CPU affinity unless the user set it; the engine writes NCCL/CUDA
variables into this process's environment and forces the ``spawn`` start method, both restored once it
is up. SGLang's own shutdown kills every child of the calling process (the trainer's tool and reward
workers too) and is registered at exit, so ``close`` stops only the engine's children instead.

Weights: ``update_weights`` pushes (hf_name, full tensor) pairs with ``update_weights_from_tensor`` in
buckets of ``rollout.update_weights_bucket_megabytes`` (SGLang fuses q/k/v and gate/up itself; a tied
head follows its embedding), flushing the radix cache after the last bucket only.

Sleep: on CUDA, ``release_memory_occupation`` / ``resume_memory_occupation`` with the ``weights`` and
``kv_cache`` tags (``enable_memory_saver``); level 2 makes the session reload the actor's weights. On CPU
SGLang has no memory saver: sleep and wake_up are no-ops and the weights and KV cache stay allocated
(the KV cache is sized to max_num_seqs x max_model_len tokens, not to a memory fraction).

Log-probs: under the sampling distribution, the convention every engine follows
(spmdrl.rollout.sampling). SGLang returns ``log softmax(logits / T)`` of the sampled token, over the whole
vocabulary even with top-k / top-p; with top-k on, the engine asks for SGLang's sampling mask instead,
whose log-probs are renormalised over the kept tokens. SGLang returns that mask only under a finite
top-k, so top-p without top-k is refused (``TOP_P_NEEDS_TOP_K``). With both on, SGLang keeps the top-k
tokens whose preceding mass in the full distribution is within top-p (one joint filter), where
transformers and vLLM apply top-p to the renormalised top-k: the kept set can be larger, and the
log-probs are those of SGLang's distribution, the one the tokens were drawn from. Greedy returns
``log_softmax(logits)`` as the others.

On CPU, SGLang runs from ``.venv-sglang`` (``.ci/sglang-venv``), where ``spmdrl/rollout/sglang_cpu.py``
bridges its CUDA-only kernel package and torchvision's ops.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

import torch

from spmdrl.checkpoint.hf_folder import per_expert
from spmdrl.parallel import rollout_coords, rollout_tp_group, rollout_tp_rank
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
    eos_ids_from_folder,
    from_leader,
    library_missing,
)
from spmdrl.rollout.sampling import row_keys, stop_id_tensor, validate_sampling

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.config import Config
    from spmdrl.config.shape import ModelShape

GB = 1024**3
# What SGLang adds to the trainer's own process on CPU: its engine front end's imports and tokenizer-free
# client state (the model lives in the scheduler processes; measured with sglang 0.5.17).
SGLANG_CPU_RUNTIME_BYTES = 230 << 20
INSTALL_HINT = ("make its environment with `bash .ci/sglang-venv` on CPU (docs/engines.md, \"SGLang "
                "rollout\"), or `pip install sglang` built for your torch on GPU")
TOP_P_NEEDS_TOP_K = ("{key}.top_p is {top_p} with {key}.top_k -1, which the sglang rollout engine cannot "
                     "run: SGLang reports log-probs renormalised after top-p only under a finite top-k; set "
                     "{key}.top_k (e.g. 50) or {key}.top_p: 1.0")
# Variables torchrun sets for its rendezvous; SGLang's children must not see them (module docstring).
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class SGLangOptions(LibraryOptions):
    """The constructor's keyword arguments: the library engines' (gpu_memory_utilization is SGLang's
    mem_fraction_static; the engine's sampling seed is seed + rollout-DP rank)."""

    per_response: bool = False  # rollout.seed_mode per_response: deterministic inference, seeded requests

    @classmethod
    def from_config(cls, cfg: "Config", device: torch.device, **own):
        return super().from_config(cfg, device, per_response=cfg.rollout.seed_mode == "per_response", **own)


def sglang_available() -> Optional[str]:
    """None when SGLang can be imported here, else why not (one sentence)."""
    return library_missing("sglang", "SGLang")


def _select_platform(device: torch.device) -> None:
    """SGLang picks its CPU code paths from ``SGLANG_USE_CPU_ENGINE`` when its modules are imported, in this
    process and in its children: set before the first import of SGLang, and kept."""
    if device.type == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


@contextlib.contextmanager
def _engine_start_env(tp: int, device: torch.device) -> Iterator[None]:
    """While SGLang starts: torchrun's variables hidden from its children (and the CPU binding set at
    TP > 1); afterwards this process's environment and multiprocessing start method exactly as before
    (module docstring)."""
    saved_env = dict(os.environ)
    saved_method = multiprocessing.get_start_method(allow_none=True)
    for k in list(os.environ):
        if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    if tp > 1 and device.type == "cpu":
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        multiprocessing.set_start_method(saved_method, force=True)


class SGLangRollout(RolloutEngine):
    """SGLang (``sglang.Engine``, its scheduler in child processes) as this rank's rollout engine.

    Args:
        model_path: HF folder SGLang builds the model from (config.json, safetensors).
        mesh: the rollout mesh (dp x tp); at tp > 1 the TP group's first rank owns an engine of SGLang TP tp.
        device: cuda (memory saver on) or cpu (sleep is a no-op).
        eos_token_ids: ids that end a response (passed as stop ids, so every engine stops alike).
        pad_token_id: fills the padding of prompt_ids / response_ids.
        options: SGLangOptions (dtype, seed, sizes, memory).
    """

    runs_split = True  # on the rollout mesh alone; the received weights go in by its bucketed push

    def __init__(self, model_path: str, *, mesh: Optional["DeviceMesh"] = None,
                 device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                 options: Optional[SGLangOptions] = None, **option_kwargs):
        _select_platform(torch.device(device))
        import sglang

        o = options or SGLangOptions(**{k: (to_dtype(v) if k == "dtype" else v)
                                        for k, v in option_kwargs.items()})
        self.options, self.device = o, torch.device(device)
        self.dp_rank, self.tp = rollout_coords(mesh)
        # At TP > 1: the group's gloo/NCCL group and its leader's global rank, which owns the engine.
        self.group, self.leader = rollout_tp_group(mesh)
        self.eos_token_ids = list(eos_token_ids) or eos_ids_from_folder(model_path)
        self.pad_token_id = pad_token_id
        self.sleep_mode = self.device.type == "cuda"
        start = time.perf_counter()
        self.engine = (self._start_engine(sglang, str(model_path))
                       if self.tp == 1 or rollout_tp_rank(mesh) == 0 else None)
        self.init_seconds = time.perf_counter() - start
        self.last_sync: dict[str, float] = {}  # seconds and bytes of the last update_weights
        self._asleep: set[str] = set()

    def _start_engine(self, sglang, model_path: str):
        o = self.options
        memory = (dict(mem_fraction_static=o.gpu_memory_utilization, enable_memory_saver=True)
                  if self.sleep_mode else {})
        # Per-request seeds need SGLang's deterministic inference, which refuses torch_native attention.
        attention = (dict(enable_deterministic_inference=True, attention_backend="triton") if o.per_response
                     else dict(attention_backend="torch_native"))
        # model.max_position_embeddings: config.json's value overridden, as SGLang takes model overrides.
        positions = o.max_position_embeddings
        overrides = dict(json_model_override_args=json.dumps({"max_position_embeddings": positions})) \
            if positions else {}
        with _engine_start_env(self.tp, self.device):
            engine = sglang.Engine(
                model_path=model_path, dtype=str(o.dtype).removeprefix("torch."),
                device=self.device.type, random_seed=o.seed + self.dp_rank, tp_size=self.tp,
                skip_tokenizer_init=True, sampling_backend="pytorch", disable_cuda_graph=True,
                context_length=o.max_model_len, max_running_requests=o.max_num_seqs,
                max_total_tokens=o.max_num_seqs * o.max_model_len, log_level="error",
                # Without it the idle scheduler polls its sockets in a busy loop, a whole core per engine
                # for the whole run, while the trainer computes next to it.
                sleep_on_idle=True, **attention, **memory, **overrides,
            )
        atexit.unregister(engine.shutdown)  # it would kill every child of this process (``close``)
        return engine

    @classmethod
    def keyed_sampling(cls, cfg: "Config") -> bool:
        return cfg.rollout.seed_mode == "per_response"

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        why = sglang_available()
        if why is not None:
            raise ValueError(f"rollout.engine is 'sglang' but {why}; {INSTALL_HINT}")
        r = cfg.rollout
        for key, sampling in (("rollout", r), ("rollout.val_kwargs", r.val_kwargs)):
            if sampling.top_p < 1.0 and sampling.top_k <= 0 and getattr(sampling, "do_sample", True):
                raise ValueError(TOP_P_NEEDS_TOP_K.format(key=key, top_p=sampling.top_p))
        from spmdrl.parallel import resolve_device_type

        device_type = resolve_device_type(cfg.trainer.device)
        if r.seed_mode == "per_response" and device_type != "cuda":
            raise ValueError(f"rollout.seed_mode is 'per_response' with rollout.engine sglang on "
                             f"{device_type}, where SGLang has no seeded sampling (its deterministic "
                             f"inference runs on GPU attention backends only); use rollout.seed_mode "
                             f"per_engine or null, or rollout.engine vllm or native")
        _select_platform(torch.device(device_type))
        if cfg.model.path.startswith("builtin:"):
            return  # the built-in models are Qwen2, which SGLang runs
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        tp = cfg.parallel.rollout_tp
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = config.get(key) or config["num_attention_heads"]
            if heads % tp and not (key == "num_key_value_heads" and tp % heads == 0):
                raise ValueError(f"parallel.rollout_tp is {tp} but model.path {cfg.model.path!r} has {key} "
                                 f"{heads}, which SGLang cannot split {tp} ways; use a rollout_tp that "
                                 f"divides it")
        archs = config.get("architectures") or []
        from sglang.srt.models.registry import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
        if not any(a in supported for a in archs):
            raise ValueError(f"model.path {cfg.model.path!r} is a "
                             f"{', '.join(archs) or 'model without architectures'}, which SGLang "
                             f"{_version()} cannot run; use rollout.engine native or hf")

    @classmethod
    def memory(cls, cfg: "Config", shape: "ModelShape", device_type: str, rollout_dp: int,
               rollout_tp: int) -> EngineMemory:
        """The engine runs in SGLang's scheduler processes (one per rollout TP rank): its weights and KV
        cache are theirs, not this process's; here a weight update serialises one bucket. On a GPU they
        share the device, so the plan leaves them mem_fraction_static of it."""
        base = super().memory(cfg, shape, device_type, rollout_dp, rollout_tp)
        bucket = min(float(cfg.rollout.update_weights_bucket_megabytes << 20), base.weights)
        where = f"SGLang's scheduler process of each rank holds the engine ({base.weights / GB:.2f} GB of " \
                f"weights, {base.kv_cache / GB:.2f} GB of KV cache or its mem_fraction_static on a GPU)"
        if device_type == "cuda":
            return replace(base, asleep=0.0, sync=bucket, elsewhere=where)
        return EngineMemory(weights=0.0, kv_cache=0.0, temporaries=0.0, asleep=0.0, sync=bucket,
                            elsewhere=where, runtime=SGLANG_CPU_RUNTIME_BYTES)

    @classmethod
    def from_config(cls, cfg: "Config", model_path: str, *, mesh: Optional["DeviceMesh"],
                    device: torch.device, eos_token_ids: Sequence[int], pad_token_id: int) -> "SGLangRollout":
        return cls(model_path, mesh=mesh, device=device, eos_token_ids=eos_token_ids,
                   pad_token_id=pad_token_id, options=SGLangOptions.from_config(cfg, device))

    # ---- weights and memory ----------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push (hf_name, full tensor) pairs into SGLang in place, bucket by bucket, then drop cached
        prefixes (their KV was computed with the old weights)."""
        if "weights" in self._asleep:
            raise RuntimeError("sglang rollout: wake_up(('weights',)) before update_weights")
        start, sent = time.perf_counter(), 0
        named_tensors = per_expert(named_tensors)  # SGLang loads one tensor an expert
        if self.engine is None:  # not the TP group's leader: pull the export (a collective), push nothing
            sent = drop_weights(named_tensors, self.options.bucket_bytes)
            self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}
            return
        pending: Optional[list[tuple[str, torch.Tensor]]] = None
        for bucket in buckets(named_tensors, self.options.bucket_bytes):
            if pending is not None:  # one bucket behind, so that only the last one flushes the cache
                self._push(pending, flush=False)
            pending = [(name, t.detach().contiguous()) for name, t in bucket]
            sent += sum(t.numel() * t.element_size() for _, t in pending)
            del bucket[:]
        if pending is not None:
            self._push(pending, flush=True)
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}

    def _push(self, bucket: list[tuple[str, torch.Tensor]], flush: bool) -> None:
        ok, message = self.engine.update_weights_from_tensor(bucket, flush_cache=flush)
        if not ok:
            raise RuntimeError(f"sglang rollout: update_weights_from_tensor failed: {message}")

    def sleep(self, level: int = 1) -> None:
        """SGLang's memory saver on CUDA (both levels free weights and KV cache; level 2 also makes the
        session reload the weights, since they are not kept); a no-op on CPU."""
        check_sleep_level(level)
        if self.sleep_mode:
            if self.engine is not None:
                self.engine.flush_cache()  # release needs an idle engine
                self.engine.release_memory_occupation(tags=list(SLEEP_TAGS))
            self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        check_wake_tags(tags)
        todo = [t for t in tags if t in self._asleep]
        if todo:
            if self.engine is not None:
                self.engine.resume_memory_occupation(tags=todo)
            self._asleep -= set(todo)

    def close(self) -> None:
        """Stop the engine's own children (scheduler, detokenizer) and nothing else of this process."""
        from sglang.srt.utils import kill_process_tree

        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # else it reports the children it sees die below as a crash
        for pid in engine.get_all_child_pids():
            kill_process_tree(pid, wait_timeout=60)

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample ``sampling.n`` responses per prompt (each prompt submitted n times: SGLang's radix cache
        shares the prefill, and the rows come back prompt-major)."""
        validate_sampling(sampling)
        if self._asleep:
            raise RuntimeError(f"sglang rollout: {sorted(self._asleep)} asleep; call wake_up first")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("sglang rollout: generate needs at least one prompt and no empty prompt")
        stops = stop_id_tensor(self.eos_token_ids, sampling, torch.device("cpu")).tolist()
        if sampling.ignore_eos and stops:
            # SGLang's ignore_eos ignores stop ids too, and without it SGLang stops at the folder's EOS.
            raise ValueError("sglang rollout: SamplingParams.ignore_eos with stop_token_ids is not supported "
                             "by SGLang (its ignore_eos drops every stop id)")
        truncated = not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1.0)
        if truncated and sampling.top_k <= 0:
            raise ValueError(TOP_P_NEEDS_TOP_K.format(key="SamplingParams", top_p=sampling.top_p))
        # At TP > 1 the leader generates the group's prompts and broadcasts the outputs.
        return from_leader(self.group, self.leader,
                           lambda: self._generate_here(prompts, sampling, stops, truncated), "sglang")

    def _generate_here(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, stops: list[int],
                       truncated: bool) -> GenerationOutput:
        n, R = sampling.n, sampling.max_tokens
        params = dict(max_new_tokens=R, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k if sampling.top_k > 0 else -1, stop_token_ids=stops,
                      ignore_eos=not stops, no_stop_trim=True)
        if self.options.per_response and sampling.keys is not None and not sampling.greedy:
            # Each response its own seed from its key (SGLang hashes it with the token position).
            seeds = row_keys(sampling.keys, n, torch.device("cpu")) & 0x7FFFFFFFFFFFFFFF  # [N]
            params = [params | {"sampling_seed": int(s)} for s in seeds.tolist()]
        outs = self._generate([list(map(int, p)) for p in prompts for _ in range(n)], params, truncated,
                              sampling.logprobs)
        samples = []
        for o in outs:
            meta = o["meta_info"]
            lp = None
            if sampling.logprobs:
                lp = (meta["output_token_sampling_logprobs"] if truncated
                      else [t[0] for t in meta["output_token_logprobs"]])
            reason = "length" if meta["finish_reason"]["type"] == "length" else "stop"
            samples.append((o["output_ids"], lp, reason))
        return GenerationOutput.from_samples(prompts, n, R, samples, self.pad_token_id)

    def _generate(self, input_ids: list[list[int]], params: dict | list[dict], truncated: bool, logprobs: bool
                  ) -> list[dict]:
        """One batched request, with the sampled tokens' log-probs when ``logprobs``; with ``truncated``,
        SGLang's sampling mask too, whose log-probs are renormalised over the kept tokens
        (``Engine.generate`` does not expose that field)."""
        if not (truncated and logprobs):
            return self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=logprobs)
        from sglang.srt.managers.io_struct import GenerateReqInput

        req = GenerateReqInput(input_ids=input_ids, sampling_params=params, return_logprob=True,
                               return_sampling_mask=True)
        return self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.generate_request(req, None).__anext__())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "(unknown version)"
