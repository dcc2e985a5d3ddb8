"""The native rollout engine: batched KV-cache sampling in pure torch (default on CPU, fallback on GPU).

    engine = build_rollout("native", "/path/to/hf_folder", dtype=torch.bfloat16, seed=0, eos_token_ids=[2])
    out = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(n=4, max_tokens=64, temperature=1.0))

How a ``generate`` call runs (one chunk of at most ``max_num_seqs`` rows at a time;
the n samples of a prompt are never split across chunks):

1. prefill the chunk's distinct prompts once, left-padded, writing K/V into cache
   rows [0, P); RoPE positions count real tokens only, as transformers does;
2. copy each prompt's cache rows n times (the n samples share one prefill) and
   sample the first token of each row from the prompt's last logits;
3. decode one token per row per step into the preallocated cache; rows that hit
   EOS / a stop id leave the batch at once (the last live rows move into their
   slots, so the cost is one copy per finished row, never a full-batch copy);
   the loop ends at max_tokens or when no row is left.

On CUDA (``cuda_graphs``) step 3 runs at fixed shapes as CUDA graphs instead (graphs.py): a bucket of rows
over one cache width, finished rows masked until a check every ``_SYNC_EVERY`` steps (never without stop
ids, e.g. with ignore_eos) drops them when the bucket can shrink.

With ``SamplingParams.keep_prefix`` (multi-turn rollouts) a row that stops keeps its
K/V until the next call; a prompt of that call that continues it (the row's tokens,
then more) gets them copied back and only its new tokens are prefilled (``extend``).

Each rank of a torchrun job runs its own engine on its own prompts (rollout DP);
rollout TP is not supported here (it needs an engine that shards).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from spmdrl.batch import route_dtype, unrouted
from spmdrl.checkpoint.hf_folder import per_expert
from spmdrl.parallel import rollout_coords
from spmdrl.precision import can_prepack, native_bf16, resolve_dtype, to_dtype
from spmdrl.rollout.base import (
    SLEEP_TAGS,
    TP_UNSUPPORTED,
    EngineMemory,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    check_sleep_level,
    check_wake_tags,
    common_kwargs,
    eos_ids_from_folder,
    left_pad,
)
from spmdrl.rollout.native.cache import KVCache, KVView
from spmdrl.rollout.native.config import DecoderConfig
from spmdrl.rollout.native.graphs import (
    GraphMode,
    StaticDecode,
    bucket_rows,
    graph_width,
    resolve_cuda_graphs,
)
from spmdrl.rollout.native.kernels import KernelMode, resolve_kernels
from spmdrl.rollout.native.kernels import ops as kernel_ops
from spmdrl.rollout.native.model import Decoder
from spmdrl.rollout.sampling import keyed_uniform, row_keys, sample, stop_id_tensor, validate_sampling

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from spmdrl.config import Config
    from spmdrl.config.shape import ModelShape

# What loading the C++ decode kernels adds to the process (measured on CPU, about 40 MB).
NATIVE_RUNTIME_BYTES = 40 << 20

log = logging.getLogger(__name__)

# Cache columns are rounded up to this so calls with slightly different lengths reuse the cache.
_SEQ_ROUND = 64
# A chunk's cache view starts this many columns past the prompt and grows by half, in multiples of it.
_WIDTH_STEP = 16
# The fixed-shape loop reads the live-row count (a host sync) every this many steps: finished rows are
# masked meanwhile, so a check only drops them when the bucket can shrink, and ends the chunk early. A
# sync idles the GPU while the host launches the next step (~0.1 ms against ~2.5 ms steps); 8 keeps that
# near 0.5%, and wastes at most 7 steps of finished rows.
_SYNC_EVERY = 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class NativeRollout(RolloutEngine):
    """Pure-torch rollout engine for Llama / Qwen2 / Qwen3 checkpoints.

    Args:
        model_path: HF folder with config.json (and safetensors unless ``load_weights=False``).
        mesh: the rollout mesh (dp x tp) or None; only tp == 1 is supported.
        device, dtype: where and in which dtype weights and KV cache live.
        max_num_seqs: most rows decoded at once; larger calls run in chunks of whole prompts.
        seed: the generator is seeded with ``seed + dp_rank`` (SamplingParams.seed reseeds it
            the same way), so ranks draw different samples and a rerun draws the same ones.
        eos_token_ids: ids that end a response; empty means the folder's generation config.
        pad_token_id: fills the padding of prompt_ids / response_ids.
        max_model_len: when set, the KV cache is allocated at wake-up for
            ``max_num_seqs x max_model_len`` and longer calls are refused; when None it is
            sized by the first call that needs more and kept until ``sleep``.
        load_weights: False builds the model with uninitialised weights, to be filled by
            ``update_weights`` (the weights then come from a stream, not the folder).
        prepack: keep oneDNN-packed copies of the matmul weights while generating (faster
            on CPU, costs one more copy of the weights until ``sleep``); None = when this CPU and
            dtype support it (``precision.can_prepack``: never for bf16 without native bf16).
        kernels: the C++ decode kernels of kernels.py: "auto" uses them when they build
            and fit the model (CPU, float32/bfloat16), "on" raises when they cannot, "off" never.
        cuda_graphs: decode steps as CUDA graphs (graphs.py): "auto" on CUDA devices, "on" raises
            elsewhere, "off" the eager loop. The fixed-shape loop they replay is ``static_decode``, which
            tests also set on CPU (it runs eagerly there: the same samples, slower).
    """

    runs_split = True
    records_routes = True

    def __init__(
        self,
        model_path: str,
        *,
        mesh: Optional["DeviceMesh"] = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_num_seqs: int = 256,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_model_len: Optional[int] = None,
        load_weights: bool = True,
        prepack: Optional[bool] = None,
        kernels: KernelMode = "auto",
        cuda_graphs: GraphMode = "auto",
        max_position_embeddings: Optional[int] = None,
    ):
        self.dp_rank, tp = rollout_coords(mesh)
        if tp > 1:
            raise ValueError(TP_UNSUPPORTED.format(tp=tp))
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.device, self.dtype = torch.device(device), to_dtype(dtype)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.seed = seed
        self.eos_token_ids = list(eos_token_ids) or eos_ids_from_folder(model_path)
        self.pad_token_id = pad_token_id
        self.config = DecoderConfig.from_folder(model_path)
        # model.max_position_embeddings (the config refuses it where RoPE reads it).
        if max_position_embeddings:
            self.config = replace(self.config, max_position_embeddings=max_position_embeddings)
        self.model = Decoder(self.config, self.device, self.dtype)
        self.prepack = can_prepack(self.device, self.dtype) if prepack is None else prepack
        if self.prepack and not can_prepack(self.device, self.dtype):
            raise ValueError(f"prepack=True needs a CPU with oneDNN and float32, or bfloat16 with native "
                             f"bf16 support; got {self.device} {self.dtype} ({native_bf16('cpu')[1]})")
        self.model.kernels = resolve_kernels(kernels, self.device, self.dtype, self.config.head_dim)
        self.cuda_graphs = resolve_cuda_graphs(cuda_graphs, self.device)
        # An MoE layer picks its experts on the host (Decoder._moe): no fixed-shape graph captures it.
        self.static_decode = self.cuda_graphs and not self.config.moe
        # MoE: every token's experts are recorded for routing replay (GenerationOutput.routed_experts).
        self.model.record_routes = self.config.moe
        self._static: Optional[StaticDecode] = None  # buffers and graphs of the current cache
        self.generator = torch.Generator(self.device).manual_seed(seed + self.dp_rank)
        self._row_keys: Optional[torch.Tensor] = None  # the keyed rows of the call in progress
        self.cache: Optional[KVCache] = None
        self._cache_shape: Optional[tuple[int, int]] = None  # (rows, seq) to restore at wake-up
        self._kv_awake = True
        self._weights_valid = False  # False until loaded; again False after sleep(2)
        # K/V of the rows of the last call made with SamplingParams.keep_prefix, by token sequence
        # ({seq: (k, v)}, k/v [L, K, len(seq), D]); the next call continues them and drops the rest.
        self._prefixes: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefill_tokens = 0  # token columns run through prefill so far (prompt rows x width)
        if load_weights:
            self.update_weights(Decoder.iter_checkpoint(model_path))
        if max_model_len is not None:
            self._ensure_cache(max_num_seqs, max_model_len)

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        r = cfg.rollout
        if cfg.parallel.rollout_tp > 1:
            raise ValueError(TP_UNSUPPORTED.format(tp=cfg.parallel.rollout_tp))
        if cfg.model.path.startswith("builtin:"):  # an architecture this decoder implements
            from spmdrl.builtin.models import builtin_config

            decoder = DecoderConfig.from_hf(builtin_config(cfg.model.path), source=cfg.model.path)
        else:
            decoder = DecoderConfig.from_folder(cfg.model.path)
        if decoder.moe and r.native_cuda_graphs == "on":
            raise ValueError(f"rollout.native_cuda_graphs is 'on' but model.path {cfg.model.path!r} is a "
                             f"Mixture-of-Experts model, whose routing no fixed-shape graph captures; set "
                             f"native_cuda_graphs to auto or off")
        if r.native_kernels == "on":
            if r.dtype == "float16":
                raise ValueError("rollout.native_kernels is 'on' with rollout.dtype float16; the kernels "
                                 "support float32 and bfloat16: change the dtype or set native_kernels to "
                                 "auto or off")
            from spmdrl.rollout.native.kernels import build_tools_available

            if not build_tools_available():
                raise ValueError("rollout.native_kernels is 'on' but g++ or ninja is not on PATH to build "
                                 "them: install both or set native_kernels to auto or off")
        if r.native_cuda_graphs == "on":
            from spmdrl.parallel import resolve_device_type

            device = resolve_device_type(cfg.trainer.device)
            if device != "cuda":
                raise ValueError(f"rollout.native_cuda_graphs is 'on' but trainer.device "
                                 f"{cfg.trainer.device!r} runs on {device}: CUDA graphs need a CUDA device; "
                                 f"set native_cuda_graphs to auto or off")

    @classmethod
    def memory(cls, cfg: "Config", shape: "ModelShape", device_type: str, rollout_dp: int,
               rollout_tp: int) -> EngineMemory:
        """The default in-process estimate, plus the oneDNN-packed copy of every matmul weight it decodes
        from on CPU (awake only) and its C++ kernels' share of the process."""
        base = super().memory(cfg, shape, device_type, rollout_dp, rollout_tp)
        dtype = resolve_dtype(cfg.rollout.dtype, device_type)
        packed = base.weights if can_prepack(torch.device(device_type), dtype) else 0.0
        return replace(base, repacked=packed, runtime=NATIVE_RUNTIME_BYTES)

    @classmethod
    def from_config(cls, cfg: "Config", model_path: str, *, mesh: Optional["DeviceMesh"],
                    device: torch.device, eos_token_ids: Sequence[int], pad_token_id: int) -> "NativeRollout":
        return cls(model_path, mesh=mesh, device=device, eos_token_ids=eos_token_ids,
                   pad_token_id=pad_token_id, kernels=cfg.rollout.native_kernels,
                   cuda_graphs=cfg.rollout.native_cuda_graphs,
                   max_position_embeddings=cfg.model.max_position_embeddings, **common_kwargs(cfg, device))

    # ---- weights and memory ----------------------------------------------------------------------

    @torch.inference_mode()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the model in place, one at a time (the same storage, so
        captured CUDA graphs decode with the new values).

        Raises KeyError on an unknown name, ValueError on a wrong shape or when the
        stream ends without some weight (a tied lm_head may be absent).
        """
        self.model.unpack()  # packed copies would be stale; generate repacks
        self._prefixes = {}  # K/V of the old weights
        self.model.weights.load(per_expert(named_tensors))
        self._weights_valid = True

    def memory_bytes(self) -> int:
        """Bytes of tensor storage the engine holds now: weights (device and CPU copies, packed
        copies) and KV cache."""
        cache = self.cache.nbytes() if self.cache is not None else 0
        return self.model.weights.nbytes() + self.model.packed_nbytes() + cache

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 also moves weights to CPU (kept in place on a CPU device),
        level 2 frees the weight storage (restore with wake_up + update_weights)."""
        check_sleep_level(level)
        self._static = None  # its graphs address the cache and, after an offload, moved weights
        self.cache = None
        self._prefixes = {}
        self._kv_awake = False
        self.model.unpack()
        if level == 1:
            self.model.weights.offload()
        else:
            self.model.weights.free()
            self._weights_valid = False

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Re-materialise "weights" (storage back; after level 2 the values come from update_weights)
        and/or "kv_cache" (reallocated at its last size)."""
        check_wake_tags(tags)
        if "weights" in tags:
            self.model.weights.onload()
            self.model.weights.materialize()
        if "kv_cache" in tags:
            self._kv_awake = True
            if self._cache_shape is not None:
                self._ensure_cache(*self._cache_shape)

    def _ensure_cache(self, rows: int, seq: int) -> KVCache:
        c = self.cache
        if c is None or c.rows < rows or c.seq < seq:
            rows = max(rows, c.rows if c is not None else 0)
            seq = max(_round_up(seq, _SEQ_ROUND), c.seq if c is not None else 0)
            self._static = self.cache = None  # drop the old one before allocating the new one
            self.cache = self.model.new_cache(rows, seq)
            self._cache_shape = (rows, seq)
        return self.cache

    # ---- generation ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample ``sampling.n`` responses per prompt; see GenerationOutput for the layout and
        spmdrl.rollout.sampling for which distribution the log-probs are under."""
        validate_sampling(sampling)
        if not self._weights_valid or not self.model.weights.materialized:
            raise RuntimeError("native rollout: weights are asleep or were freed; call wake_up(('weights',)) "
                               "(and update_weights after sleep(2)) before generate")
        if not self._kv_awake:
            raise RuntimeError("native rollout: the KV cache is asleep; call wake_up(('kv_cache',)) first")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("native rollout: generate needs at least one prompt and no empty prompt")
        n, R = sampling.n, sampling.max_tokens
        P_all = max(len(p) for p in prompts)
        if self.max_model_len is not None and P_all + R > self.max_model_len:
            raise ValueError(f"native rollout: prompt ({P_all}) + max_tokens ({R}) exceeds "
                             f"max_model_len={self.max_model_len}")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed + self.dp_rank)
        if self.prepack and not self.model.packed:
            self.model.pack()
        per_chunk = max(1, self.max_num_seqs // n)
        cache = self._ensure_cache(min(len(prompts), per_chunk) * n, P_all + R)
        stop_ids = stop_id_tensor(self.eos_token_ids, sampling, self.device)

        N = len(prompts) * n
        # Each row's own noise (SamplingParams.keys): row i*n + j draws from (keys[i], j, position).
        self._row_keys = row_keys(sampling.keys, n, self.device) if sampling.keys is not None else None
        out_ids = torch.full((N, R), self.pad_token_id, dtype=torch.long, device=self.device)
        out_lp = torch.zeros(N, R, dtype=torch.float32, device=self.device)
        stopped = torch.zeros(N, dtype=torch.bool, device=self.device)
        kept, self._prefixes = self._prefixes, {}  # entries this call does not continue are dropped
        routes = None
        if self.model.record_routes:  # [N, P+R, L, k]; a token never fed through the model keeps no route
            c = self.config
            routes = torch.full((N, P_all + R, c.num_layers, c.experts_per_token),
                                unrouted(c.num_experts), dtype=route_dtype(c.num_experts), device=self.device)
        for s in range(0, len(prompts), per_chunk):
            self._generate_chunk(prompts[s:s + per_chunk], s * n, sampling, cache, stop_ids,
                                 out_ids, out_lp, stopped, kept, routes)

        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, self.device)
        idx = torch.arange(len(prompts), device=self.device).repeat_interleave(n)  # [N]
        # A row writes tokens until its first stop id, so that id ends the response mask
        # (unwritten columns hold padding, which may equal EOS but only after the real stop).
        first = torch.where(stopped, torch.isin(out_ids, stop_ids).int().argmax(-1) + 1, R)  # [N]
        mask = torch.arange(R, device=self.device)[None, :] < first[:, None]  # [N, R]
        return GenerationOutput(
            prompt_ids=prompt_ids[idx].cpu(),
            prompt_mask=prompt_mask[idx].cpu(),
            response_ids=out_ids.cpu(),
            response_mask=mask.cpu(),
            logprobs=out_lp.cpu(),
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
            prompt_index=idx.cpu(),
            routed_experts=None if routes is None else routes.cpu(),
        )

    def _restore_prefixes(self, prompts: Sequence[Sequence[int]], kept: dict, kv: KVView, T: int) -> int:
        """Copy the kept K/V of every prompt that continues a kept row into its (left-padded) cache row;
        returns the first column that still needs a prefill (0: none continues)."""
        lengths = sorted({len(s) for s in kept}, reverse=True)
        new = []  # per prompt: tokens not in the cache
        for i, p in enumerate(prompts):
            hit = next((L for L in lengths if L < len(p) and tuple(p[:L]) in kept), 0)
            if hit:
                k, v = kept[tuple(p[:hit])]
                c = T - len(p)
                kv.k[:, i, :, c:c + hit] = k
                kv.v[:, i, :, c:c + hit] = v
            new.append(len(p) - hit)
        return T - max(new)

    def _keep_prefixes(self, slots: Sequence[int], rows: torch.Tensor, row0: int, n: int,
                       prompts: Sequence[Sequence[int]], out_ids: torch.Tensor, kv: KVView, T: int,
                       steps: Sequence[int]) -> None:
        """Keep the K/V of the rows in batch ``slots`` that stopped at response positions ``steps``: their
        prompt and every generated token but the stop token (sampled, never fed), i.e. the columns their
        bias opened before it (the fixed-shape loop opens later columns of finished rows too)."""
        for slot, step in zip(slots, steps):
            out_row = int(rows[slot])
            seq = tuple(prompts[(out_row - row0) // n]) + tuple(out_ids[out_row, :step].tolist())
            cols = kv.bias[slot, :T + step] == 0  # [T + step]
            if int(cols.sum()) == len(seq):
                k, v = kv.k[:, slot, :, :T + step], kv.v[:, slot, :, :T + step]  # [L, K, T + step, D]
                self._prefixes[seq] = (k[:, :, cols], v[:, :, cols])  # [L, K, len, D]

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams, rows: torch.Tensor, position: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """sampling.sample, or the C++ kernel for its untruncated and greedy cases (same convention);
        ``rows``: the output row of each batch slot, ``position``: the response position being drawn."""
        V = logits.shape[-1]
        u = None
        if self._row_keys is not None and not sampling.greedy:
            u = keyed_uniform(self._row_keys[rows], position)  # [B]
        if self.model.kernels and sampling.top_p >= 1.0 and (sampling.top_k < 0 or sampling.top_k >= V):
            if sampling.greedy:
                return kernel_ops.sample(logits, logits.new_empty(0), 0.0)
            if u is None:
                u = torch.rand(logits.shape[0], generator=self.generator, device=logits.device)
            return kernel_ops.sample(logits, u, sampling.temperature)
        return sample(logits, sampling, self.generator, u=u)

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], row0: int, sampling: SamplingParams,
                        cache: KVCache, stop_ids: torch.Tensor, out_ids: torch.Tensor, out_lp: torch.Tensor,
                        stopped: torch.Tensor, kept: dict, routes: Optional[torch.Tensor]) -> None:
        """Generate rows [row0, row0 + len(prompts)*n) of the outputs (written in place); with ``routes``
        [N, P+R, L, k] (an MoE model), the experts of every token the model ran on."""
        dev, n, R = self.device, sampling.n, sampling.max_tokens
        ids, valid = left_pad(prompts, self.pad_token_id, dev)  # [P, T]
        P, T = ids.shape
        B = P * n
        full = T + R
        static = None
        if self.static_decode:  # one view of all cache rows at one width: the graphs' fixed addresses
            if self._static is None or not self._static.serves(self.model, cache):
                self._static = StaticDecode(self.model, cache, capture=self.cuda_graphs)
            static, width = self._static, graph_width(full, cache.seq)
            kv: KVView = static.view(width)
        else:  # the view starts narrow and widens as tokens arrive (see KVCache.widen)
            width = min(full, _round_up(T + _WIDTH_STEP, _WIDTH_STEP))
            kv = cache.layout(B, width)
        pos = (valid.long().cumsum(-1) - 1).clamp_(min=0)  # RoPE positions count real tokens only
        start = self._restore_prefixes(prompts, kept, kv, T) if n == 1 and kept else 0
        if start:  # only columns [start, T) are new; the rest came from the last call
            hidden = self.model.extend(ids[:, start:], pos[:, start:], valid, kv, start)  # [P, T-start, h]
        else:
            hidden = self.model.prefill(ids, pos, valid, kv)  # [P, T, h]
        self.prefill_tokens += P * (T - start)
        if routes is not None:  # prompt i's tokens, in its n rows; the prompts end at column P_all
            P_all = routes.shape[1] - R
            chunk = self.model.take_routes().view(P, T - start, *routes.shape[2:]).to(routes.dtype)
            routes[row0:row0 + B, P_all - T + start:P_all] = chunk.repeat_interleave(n, 0)
        logits = self.model.logits(hidden[:, -1])  # [P, V]
        if n > 1:  # share the prefill: row i*n + j is sample j of prompt i
            src = torch.arange(P, device=dev).repeat_interleave(n)
            kv.k[:, :B, :, :T] = kv.k[:, src, :, :T]
            kv.v[:, :B, :, :T] = kv.v[:, src, :, :T]
            logits, valid = logits[src], valid[src]
        kv.bias.fill_(float("-inf"))
        kv.bias[:B, :T] = torch.where(valid, 0.0, float("-inf"))
        rows = torch.arange(row0, row0 + B, device=dev)  # output row of each live batch slot
        next_pos = valid.sum(-1)  # [B] position of the next token = prompt length
        tokens, lp = self._sample(logits, sampling, rows, 0)
        if static is not None:
            self._decode_static(static, kv, T, rows, tokens, lp, next_pos, sampling, stop_ids, out_ids,
                                out_lp, stopped, prompts, row0)
            return
        for step in range(R):
            out_ids[rows, step] = tokens
            out_lp[rows, step] = lp
            done = torch.isin(tokens, stop_ids)
            any_done = bool(done.any())
            if any_done:
                stopped[rows[done]] = True
                if sampling.keep_prefix:
                    slots = done.nonzero().squeeze(-1).tolist()
                    self._keep_prefixes(slots, rows, row0, n, prompts, out_ids, kv, T, [step] * len(slots))
            if step == R - 1:
                break
            if any_done:
                keep = ~done
                B = int(keep.sum())
                if B == 0:
                    break
                # Move the live rows from the tail into the holes left in [0, B).
                holes = (~keep[:B]).nonzero().squeeze(-1)
                tail = keep[B:].nonzero().squeeze(-1) + B
                if holes.numel():
                    kv.move_rows(holes, tail)
                    for t in (rows, tokens, next_pos):
                        t[holes] = t[tail]
                rows, tokens, next_pos = rows[:B], tokens[:B], next_pos[:B]
            col = T + step  # cache column this step's input token goes to
            if col >= width:
                width = min(full, _round_up(max(col + 1, width * 3 // 2), _WIDTH_STEP))
                kv = cache.widen(kv, width)
            kv.bias[:B, col] = 0.0
            logits = self.model.decode(tokens, next_pos + step, kv, col, B)
            if routes is not None:  # response token ``step`` of each live row, fed in this decode
                routes[rows, routes.shape[1] - R + step] = self.model.take_routes().to(routes.dtype)
            tokens, lp = self._sample(logits, sampling, rows, step + 1)

    def _decode_static(self, static: StaticDecode, kv: KVView, T: int, rows: torch.Tensor,
                       tokens: torch.Tensor, lp: torch.Tensor, next_pos: torch.Tensor,
                       sampling: SamplingParams, stop_ids: torch.Tensor, out_ids: torch.Tensor,
                       out_lp: torch.Tensor, stopped: torch.Tensor, prompts: Sequence[Sequence[int]],
                       row0: int) -> None:
        """The decode loop of ``_generate_chunk`` at fixed shapes (graphs.py), from the first sampled
        ``tokens`` / ``lp`` [B] of the chunk's rows (``rows``, RoPE positions ``next_pos``) on.

        Slots [0, B) hold rows that were live at the last check; a finished one stays (masked: it writes
        padding) until a check finds the bucket can shrink, and the live rows then move into [0, live).
        Without stop ids no row can finish, and the loop never reads anything back.
        """
        R, B, cap = sampling.max_tokens, rows.shape[0], static.cache.rows
        keyed = self._row_keys is not None and not sampling.greedy
        static.start(tokens, lp, next_pos, self._row_keys[rows] if keyed else None, T)
        kv.bias[B:, 0] = 0.0  # a padding slot attends to one (finite) column, so its softmax is finite
        stops = stop_ids.numel() > 0
        alive = torch.ones(B, dtype=torch.bool, device=self.device)  # [B]
        kept: set[int] = set()  # slots whose K/V keep_prefix already kept

        def keep_finished() -> None:
            stopped[rows] = ~alive
            slots = [s for s in (~alive).nonzero().squeeze(-1).tolist() if s not in kept]
            if sampling.keep_prefix and slots:
                ends = torch.isin(out_ids[rows[slots]], stop_ids).int().argmax(-1).tolist()  # stop positions
                self._keep_prefixes(slots, rows, row0, sampling.n, prompts, out_ids, kv, T, ends)
                kept.update(slots)

        for step in range(R):
            tok, tok_lp = static.tokens[:B], static.lp[:B]
            if stops:
                out_ids[rows, step] = torch.where(alive, tok, self.pad_token_id)
                out_lp[rows, step] = torch.where(alive, tok_lp, 0.0)
                alive &= ~torch.isin(tok, stop_ids)
            else:
                out_ids[rows, step] = tok
                out_lp[rows, step] = tok_lp
            if step == R - 1:
                break
            if stops and step % _SYNC_EVERY == _SYNC_EVERY - 1:
                live = int(alive.sum())
                if live == 0:
                    break
                if bucket_rows(live, cap) < bucket_rows(B, cap):
                    keep_finished()
                    holes = (~alive[:live]).nonzero().squeeze(-1)
                    tail = alive[live:].nonzero().squeeze(-1) + live
                    kv.move_rows(holes, tail)
                    static.move(holes, tail)
                    rows[holes], alive[holes] = rows[tail], alive[tail]
                    rows, alive, B = rows[:live], alive[:live], live
                    kept.clear()  # the kept slots were moved over or dropped
            static.step(kv, bucket_rows(B, cap), sampling, keyed, self.generator)
        if stops:
            keep_finished()
