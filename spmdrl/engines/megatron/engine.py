"""Megatron training engine: megatron-core GPTModel with tensor and pipeline parallelism.

``actor.strategy: megatron`` builds the actor, the frozen reference and the
critic as megatron-core ``GPTModel``s from the HF folder (``convert.py``:
config and the HF <-> Megatron conversion), cut ``parallel.tp`` x ``parallel.pp``
ways; the remaining ranks are data parallel. The critic's last stage has a
scalar value head where the LM head was (``convert.ValueHead``), so it
runs through the same schedule, optimizer, checkpoints and export. Every rank
runs it under torchrun like the rest of spmdrl:

    engine = MegatronEngine(path, role="actor", dims=ParallelDims(world, tp=2).build(), lr=1e-5)
    logp = engine.forward_no_grad(batch, micro_batch_size=8)["logp"]          # [N, R]
    metrics = engine.train_step(batch, loss_fn, mini_batch_size=8, micro_batch_size=4)
    critic = MegatronEngine(path, role="critic", dims=dims, lr=1e-5)
    values = critic.forward_no_grad(batch, micro_batch_size=8)["values"]      # [N, R]

Data: the batch is sharded over the world; the ranks of one model replica (its
TP x PP group, the engine's ``_replica_group``) gather their rows (``gather_rows``)
so they run the same micro-batches, and keep their own rows of the outputs. The
optimizer step is ``TrainEngine.train_step``, whose hooks this file fills; its
micro-batches go through Megatron's ``get_forward_backward_func()``: the
no-pipelining schedule at pp=1, 1F1B (``forward_backward_pipelining_without_interleaving``)
at pp>1, so stages exchange activations with isend/irecv and only the last stage
computes losses.

Rows are left-aligned before the forward: Megatron's RoPE numbers positions by
their index in the sequence (it ignores ``position_ids``), so a left-padded
prompt would get shifted positions. Shifting each row left by its padding makes
index = position; the causal mask keeps the right padding out of every valid
token's attention, so no padding mask is needed.

Optimizer: torch AdamW over this rank's shards, with gradients summed over the
data-parallel group by one all-reduce and the tied embedding's two pipeline copies
summed over Megatron's embedding group (``_finish_grads``), and the global norm taken
once per parameter (``_clip_grads``: TP-replicated norms counted on TP rank 0, the
tied copy once). Loss metrics come from TP rank 0 of each last stage
(``_reduce_loss_metrics``).
AdamW is elementwise, so this is exactly the update of one rank holding the
whole model. Megatron's DDP and distributed optimizer are not used: their
contiguous gradient buffers and streams are CUDA-only, and the plain optimizer
keeps CPU tests exact against FSDP2.

On CPU every call into Megatron runs under ``cpu.cpu_compat()``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import TYPE_CHECKING, Iterator, Literal, Optional

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.engines.base import Layout, LossFn, LossScale, ModelRole, TrainEngine, loss_metric_means
from spmdrl.engines.logprobs import token_outputs
from spmdrl.engines.megatron.convert import (
    HFArch,
    HFWeights,
    build_gpt_model,
    global_rules,
    layer_rules,
    load_hf_state,
    local_rules,
    to_hf,
    transformer_config,
)
from spmdrl.engines.megatron.cpu import compat_context
from spmdrl.engines.megatron.setup import init_model_parallel, join_as_bystander, model_arch, quiet_megatron
from spmdrl.engines.optim import build_optimizer, build_scheduler, optimizer_settings, value_head_weight
from spmdrl.precision import resolve_dtype

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

# What a Megatron run adds to the process after its config is checked: megatron-core, torch.distributed and
# the CPU compatibility layer, beyond the megatron-core import the config check makes (measured on CPU).
MEGATRON_RUNTIME_BYTES = 190 << 20


class MegatronEngine(TrainEngine):
    """One GPTModel shard (this rank's TP slice of its PP stage) and, for the actor and critic, its AdamW.

    Args:
        model_path: Hugging Face model folder (Llama / Qwen2 / Qwen3 architecture).
        role: "actor" (trained), "ref" (frozen, no optimizer) or "critic" (trained; the LM head is
            replaced by a scalar value head, ``convert.ValueHead``, initialised as FSDP2's).
        dims: the run's parallel degrees with meshes built; uses tp, pp and the DP mesh.
        device: cpu (gloo, under ``cpu_compat``) or this rank's cuda device.
        param_dtype: compute dtype; bfloat16 runs the forward (and so the backward) under
            ``torch.autocast`` over the float32 weights: float32 master weights, gradients and
            AdamW state, bf16 matmuls, as FSDP2's mixed-precision policy computes.
        temperature: logits are divided by it before log-probs and entropy.
        lr, weight_decay, betas, lr_warmup_steps, lr_scheduler, min_lr_ratio, total_steps:
            AdamW and ``optim.WarmupSchedule``, as the FSDP2 engine.
        max_grad_norm: clip threshold (0: no clipping; the norm is reported either way).
        seed: Megatron's RNG tracker seed, and the critic's value-head init (``value_head_weight``).
    """

    strategy = "megatron"

    def __init__(
        self,
        model_path: str,
        *,
        role: ModelRole,
        dims: "ParallelDims",
        device: torch.device | str = "cpu",
        param_dtype: torch.dtype = torch.float32,
        temperature: float = 1.0,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_warmup_steps: int = 0,
        lr_scheduler: Literal["constant", "cosine"] = "constant",
        min_lr_ratio: float = 0.0,
        total_steps: int | None = None,
        max_grad_norm: float = 1.0,
        seed: int = 0,
    ):
        if role not in ("actor", "ref", "critic"):
            raise ValueError(f"megatron engine role {role!r} is not supported; valid: actor, ref, critic")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts score at "
                             f"temperature 1)")
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"megatron engine param_dtype {param_dtype} is not supported; valid: float32, "
                             f"bfloat16")
        self.role = role
        self.device = torch.device(device)
        self.param_dtype = param_dtype
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.global_step = 0
        self._join_groups(dims, seed)
        self._load(model_path, seed)
        if role == "ref":
            self.model.requires_grad_(False)
        self.optimizer: torch.optim.AdamW | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if role != "ref":
            self.optimizer = build_optimizer(self.model, lr, weight_decay, betas)
            self.scheduler = build_scheduler(self.optimizer, lr_warmup_steps, lr_scheduler, min_lr_ratio,
                                             total_steps)

    def _join_groups(self, dims: "ParallelDims", seed: int) -> None:
        """Megatron's parallel state over the train mesh of ``dims``, and this rank's place in it."""
        with quiet_megatron():
            from megatron.core import parallel_state as ps

        self.tp, self.pp, self._dp_size = dims.tp, dims.pp, dims.dp
        self._train_group = dims.group("train") if dims.split else None  # every training rank
        init_model_parallel(dims, self.device, seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)  # global rank of each stage
        in_embedding = self.pp > 1 and ps.is_rank_in_embedding_group()
        self.embedding_group = ps.get_embedding_group() if in_embedding else None

    def _load(self, model_path: str, seed: int) -> None:
        """This rank's GPTModel stage, TP-sliced, with the HF weights of ``model_path`` (a critic's value
        head from ``value_head_weight``), on ``device``."""
        self.arch = HFArch.from_folder(model_path)
        self.arch.check_parallel(self.tp, self.pp)
        extra = {}
        if self.role == "critic":  # HF's *ForTokenClassification: backbone + score, no LM head to tie
            self.arch = dataclasses.replace(self.arch, value_head=True, tie_word_embeddings=False)
            extra = {"score.weight": value_head_weight(self.arch.hidden_size, seed),
                     "score.bias": torch.zeros(1)}
        with quiet_megatron():
            self.config = transformer_config(self.arch, self.tp, self.pp, self.param_dtype)
        with self._compat(), quiet_megatron():
            self.model = build_gpt_model(self.arch, self.config, pre_process=self.pp_rank == 0,
                                         post_process=self.pp_rank == self.pp - 1)
        hf = HFWeights(model_path, extra)
        converted = {h for _, _, names in self._export_plan() for h in names} | {"lm_head.weight"}
        unused = sorted(hf.names() - converted)
        if unused:  # a weight no rule converts would be silently dropped: a different model
            raise ValueError(f"{model_path}: weights {unused[:3]} have no Megatron conversion rule")
        self._hf_shapes = {k: hf.shape(k) for k in hf.names()}
        load_hf_state(self.model, hf, self.arch, self.tp_rank, self.tp)
        del hf
        self.model.to(self.device)

    @classmethod
    def layout(cls, cfg: "Config", dims: "ParallelDims", layers: int) -> Layout:
        """Weights and AdamW state cut tp x pp ways and replicated over data parallelism (no FSDP), a
        stage's layers, and up to pp micro-batches in flight on a stage under 1F1B."""
        return Layout(shards=dims.tp * dims.pp, tp=dims.tp, layers_per_rank=-(-layers // dims.pp),
                      gathers=False, runtime_bytes=MEGATRON_RUNTIME_BYTES)

    @classmethod
    def join_as_bystander(cls, dims: "ParallelDims") -> None:
        with quiet_megatron():
            join_as_bystander(dims)

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        from spmdrl.algos.registry import ADVANTAGES
        from spmdrl.parallel import resolve_device_type

        if cfg.reward_model.enable:
            raise ValueError("reward_model.enable is true but actor.strategy 'megatron' builds no reward "
                             "model (a sequence-classification head); set actor.strategy: fsdp2 to use one")
        if cfg.parallel.sp > 1:
            raise ValueError(f"parallel.sp is {cfg.parallel.sp} with actor.strategy 'megatron': "
                             f"megatron-core's context parallelism needs Transformer Engine's attention, "
                             f"which is not installed here; use actor.strategy fsdp2 for Ulysses")
        compute = resolve_dtype(cfg.actor.param_dtype, resolve_device_type(cfg.trainer.device))
        if compute not in (torch.float32, torch.bfloat16) or cfg.actor.reduce_dtype != "float32":
            raise ValueError(f"actor.param_dtype {cfg.actor.param_dtype!r} / actor.reduce_dtype "
                             f"{cfg.actor.reduce_dtype!r}: actor.strategy 'megatron' computes in float32 or "
                             f"bfloat16 and reduces gradients in float32; use those")
        paths = [cfg.model.path]
        if ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_values") and cfg.critic.model_path:
            paths.append(cfg.critic.model_path)
        for path in paths:  # each model must cut into tp x pp pieces
            arch = model_arch(path)
            if arch is not None:
                arch.check_parallel(cfg.parallel.tp, cfg.parallel.pp)
        c = cfg.critic
        for key, rank in (("model.lora_rank", cfg.model.lora_rank), ("critic.lora_rank", c.lora_rank)):
            if rank > 0 or (key == "model.lora_rank" and cfg.model.lora_adapter_path):
                raise ValueError(f"{key} asks for LoRA but actor.strategy 'megatron' trains full weights "
                                 f"(megatron-core's LoRA lives in NeMo, not in megatron-core); set "
                                 f"actor.strategy: fsdp2 for LoRA")
        # model.use_remove_padding / critic.use_remove_padding pass: packing changes what is computed on, not
        # the results (1e-5), so the Megatron engine runs the same rows padded (configs/grpo.yaml packs).
        for key, on in (("actor.use_dynamic_bsz", cfg.actor.use_dynamic_bsz),
                        ("actor.log_prob_use_dynamic_bsz", cfg.actor.log_prob_use_dynamic_bsz),
                        ("ref.log_prob_use_dynamic_bsz", cfg.ref.log_prob_use_dynamic_bsz),
                        ("critic.use_dynamic_bsz", c.use_dynamic_bsz)):
            if on:
                raise ValueError(f"{key} is true but actor.strategy 'megatron' runs padded rows in "
                                 f"micro-batches of a fixed number of rows; set it to false, or "
                                 f"actor.strategy: fsdp2")
        if cfg.model.fused_kernels == "on":
            raise ValueError("model.fused_kernels is 'on' but actor.strategy 'megatron' runs Megatron's own "
                             "layers; set it to auto or off")
        if cfg.model.dtype != "float32":
            raise ValueError(f"model.dtype is {cfg.model.dtype!r} but actor.strategy 'megatron' keeps "
                             f"float32 weights; set model.dtype: float32")
        if cfg.model.enable_gradient_checkpointing is True:
            raise ValueError("model.enable_gradient_checkpointing is true but actor.strategy 'megatron' has "
                             "no activation recomputation here; set it to false")
        if cfg.actor.cpu_offload or cfg.ref.offload:
            raise ValueError("actor.cpu_offload / ref.offload is true but actor.strategy 'megatron' keeps "
                             "its parameters on the device; set them to false")
        if cfg.parallel.dp_replicate > 1:
            raise ValueError(f"parallel.dp_replicate is {cfg.parallel.dp_replicate} but actor.strategy "
                             f"'megatron' has one flat data-parallel group; set parallel.dp_replicate: 1")

    @classmethod
    def from_config(
        cls,
        cfg: "Config",
        role: ModelRole,
        *,
        model_path: str,
        dims: "ParallelDims",
        device: torch.device | str,
        total_steps: int | None,
    ) -> "MegatronEngine":
        compute = resolve_dtype(cfg.actor.param_dtype, torch.device(device).type)
        common = dict(role=role, dims=dims, device=device, seed=cfg.trainer.seed, param_dtype=compute,
                      temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0)
        if role == "ref":
            return cls(model_path, **common)
        if role == "critic":  # model_path: critic.model_path or model.path, resolved by the caller
            c = cfg.critic
            return cls(model_path, lr=c.lr, weight_decay=c.weight_decay, lr_warmup_steps=c.lr_warmup_steps,
                       total_steps=total_steps, max_grad_norm=c.max_grad_norm, **common)
        a = cfg.actor
        return cls(model_path, lr=a.lr, weight_decay=a.weight_decay, betas=tuple(a.betas),
                   lr_warmup_steps=a.lr_warmup_steps, lr_scheduler=a.lr_scheduler,
                   min_lr_ratio=a.min_lr_ratio, total_steps=total_steps, max_grad_norm=a.max_grad_norm,
                   **common)

    def _compat(self):
        return compat_context(self.device)

    def num_params(self) -> int:
        """Parameters of the full model (from the HF weights; tied weights counted once)."""
        return sum(math.prod(self._hf_shapes[h]) for _, _, names in self._export_plan() for h in names)

    # ------------------------------------------------------------------ data parallelism

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def dp_groups(self) -> list[dist.ProcessGroup]:
        return [self.dp_group]

    @property
    def _replica_group(self) -> dist.ProcessGroup | None:
        return None if self.tp * self.pp == 1 else self.mp_group

    def _is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    # ------------------------------------------------------------------ forward

    def _prepare(self, micro: Batch) -> dict[str, torch.Tensor]:
        """Left-aligned model inputs of a micro-batch and where its response tokens are predicted."""
        ids, attn = micro["input_ids"], micro["attention_mask"]  # [n, T]
        resp = micro["response_mask"].shape[1]
        n, total = ids.shape
        lead = (attn.cumsum(1) == 0).sum(1)  # [n] left padding of each row
        length = int(attn.sum(1).max())  # the longest row, after alignment
        cols = (torch.arange(length, device=ids.device) + lead[:, None]).clamp(max=total - 1)  # [n, L]
        # Logit j of a row predicts its response token j: index (prompt end - 1 + j) after the shift.
        keep = (total - resp - 1 + torch.arange(resp, device=ids.device))[None] - lead[:, None]  # [n, R]
        return {
            "ids": ids.gather(1, cols),  # [n, L]
            "positions": torch.arange(length, device=ids.device)[None].expand(n, -1),  # [n, L]
            "causal": torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)[None, None],
            "keep": keep.clamp(0, length - 1),  # past a row's end: padding, masked by response_mask
            "labels": ids[:, -resp:],  # [n, R]
        }

    def _forward_step(self, data: Iterator[Batch], model, *, loss_fn: LossFn | None, scale: LossScale | None,
                      with_entropy: bool, entropy_grad: bool):
        """Megatron's forward_step_func: one micro-batch through this stage, and its loss function."""
        micro = next(data)
        x = self._prepare(micro)
        out = model(x["ids"], x["positions"], x["causal"])  # [n, L, H] (critic's last stage: [n, L, 1])
        return out, partial(self._loss, micro, x, loss_fn, scale, with_entropy, entropy_grad)

    def _loss(self, micro: Batch, x: dict, loss_fn: LossFn | None, scale: LossScale | None,
              with_entropy: bool, entropy_grad: bool, out: torch.Tensor):
        """Last stage: per-token outputs, then the loss; Megatron's (loss, tokens, data) triple. With
        ``calculate_per_token_loss`` Megatron back-propagates the loss as is: ours already divides by
        the mini-batch's global token count. The actor's final hidden states [n, L, H] at the positions
        that predict response tokens go through the fused log-prob kernel with this rank's vocabulary
        rows (padded rows left out); a critic's values [n, L, 1] are read at the same positions (as
        FSDP2's critic), so values[:, j] scores response token j."""
        if self.role == "critic":
            outputs = {"values": out[..., 0].gather(1, x["keep"]).float()}  # [n, R]
        else:
            hidden = out.gather(1, x["keep"][..., None].expand(-1, -1, out.shape[-1]))  # [n, R, H]
            outputs = token_outputs(hidden, self._head_weight(), x["labels"], self.temperature, with_entropy,
                                    entropy_grad, tp_group=self.tp_group if self.tp > 1 else None,
                                    vocab=self.arch.vocab_size)
        tokens = torch.zeros((), dtype=torch.int)
        if loss_fn is None:
            return torch.zeros((), device=out.device), tokens, outputs
        loss, metrics = loss_fn(outputs, micro, scale)
        return loss, tokens, metrics

    def _head_weight(self) -> torch.Tensor:
        """This rank's [V_pad / tp, H] rows of the LM head: the embedding's where tied on one stage."""
        m = self.model
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights \
            else m.output_layer.weight

    def _run_schedule(self, micros: list[Batch], forward_only: bool, **step_kw) -> list:
        """Micro-batches through Megatron's schedule; the last stage returns what ``_loss`` returned."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # bf16 compute: forward and backward inside the autocast. Megatron's TP linear layers restore the
        # forward's autocast state in their backward only for CUDA (custom_bwd(device_type="cuda")); on the
        # CPU their backward would otherwise multiply bf16 gradients with float32 weights.
        autocast = torch.autocast(self.device.type, dtype=self.param_dtype,
                                  enabled=self.param_dtype != torch.float32)
        with self._compat(), autocast:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, **step_kw),
                data_iterator=iter(micros),
                model=[self.model],
                num_microbatches=len(micros),
                seq_length=int(micros[0]["attention_mask"].sum(1).max()),
                micro_batch_size=len(micros[0]),
                forward_only=forward_only,
            )

    def forward_no_grad(self, batch: Batch, micro_batch_size: int, with_entropy: bool = False,
                        max_token_len: Optional[int] = None) -> dict[str, torch.Tensor]:
        """{"logp", optional "entropy"} (actor, ref) or {"values"} (critic): each [N, R] float32 on the
        batch's device, for this rank's rows. Micro-batches are cut by rows only (``check_config``)."""
        if max_token_len is not None:
            raise ValueError("actor.strategy 'megatron' cuts micro-batches by rows only; max_token_len is "
                             "not supported")
        self._check_rows(len(batch))
        full = self._gather(batch)
        micros = [m.to(self.device) for m in full.split(micro_batch_size)]
        self.model.eval()
        with torch.no_grad():
            store = self._run_schedule(micros, True, loss_fn=None, scale=None, with_entropy=with_entropy,
                                       entropy_grad=False)
        keys = ["values"] if self.role == "critic" else ["logp"] + (["entropy"] if with_entropy else [])
        shape = (len(full), full["response_mask"].shape[1])
        if self._is_last_stage():
            out = {k: torch.cat([s[k] for s in store]).float() for k in keys}
        else:
            out = {k: torch.empty(shape, dtype=torch.float32, device=self.device) for k in keys}
        if self.pp > 1:  # only the last stage has outputs
            for k in keys:
                out[k] = out[k].to(self._comm_device()).contiguous()
                dist.broadcast(out[k], src=self.pp_ranks[-1], group=self.pp_group)
        return self._own_rows(out, batch)

    # ------------------------------------------------------------------ training

    def _forward_backward(self, micros: list[Batch], loss_fn: LossFn, scale: LossScale, with_entropy: bool,
                          entropy_grad: bool) -> list[dict[str, float]]:
        """The micro-batches through Megatron's schedule (1F1B under PP); the last stage's metrics."""
        return self._run_schedule(micros, False, loss_fn=loss_fn, scale=scale, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad)

    def _finish_grads(self) -> None:
        """Sum gradients over data-parallel replicas, and the tied embedding's first and last stage copies."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every replica must reduce the same buffers
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.embedding_group is not None and self.arch.tie_word_embeddings:
            shared = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=self.embedding_group)

    def _clip_grads(self) -> float:
        """Global gradient norm (each parameter counted once over TP and PP), clipped like FSDP2's
        ``clip_grad_norm_``; returns the norm before clipping."""
        grads, counted = [], []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            tp_unique = getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0
            if tp_unique and not getattr(p, "shared", False):  # "shared": the tied copy of the last stage
                counted.append(p.grad)
        sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros(())
        sq = sq.to(self._comm_device(), torch.float64)
        if self.tp * self.pp > 1:
            dist.all_reduce(sq, group=self.mp_group)
        total = math.sqrt(float(sq))
        if self.max_grad_norm > 0 and math.isfinite(total) and total > self.max_grad_norm:
            torch._foreach_mul_(grads, self.max_grad_norm / (total + 1e-6))
        return total

    def _reduce_loss_metrics(self, sums: dict[str, float], n_micro: int, shares: set[str], n_mini: int
                             ) -> dict[str, float]:
        """Loss metrics over micro-batches and replicas (``TrainEngine.train_step``): only the last stage
        has them, and its TP ranks hold copies, so TP rank 0 of each last stage contributes."""
        keys = [sorted(sums), sorted(shares)]
        if self.pp > 1:
            dist.broadcast_object_list(keys, src=self.pp_ranks[-1], group=self.pp_group)
        contributes = self._is_last_stage() and self.tp_rank == 0
        values = [sums.get(k, 0.0) for k in keys[0]] + [float(n_micro)]
        t = torch.tensor(values if contributes else [0.0] * len(values), dtype=torch.float64,
                         device=self._comm_device())
        dist.all_reduce(t, group=self._train_group)
        return loss_metric_means(keys[0], t, set(keys[1]), n_mini)

    # ------------------------------------------------------------------ weights, memory, checkpoints

    def _export_plan(self) -> list[tuple[int, object, tuple[str, ...]]]:
        """(owning stage, rule, HF names) of every exported tensor, in HF order; a tied head is left out,
        a critic's value head (``score.weight``, ``score.bias``) comes last."""
        per_stage = self.arch.num_layers // self.pp
        embed, norm, *heads = global_rules(self.arch)
        plan = [(0, embed, embed.hf)]
        for i in range(self.arch.num_layers):
            plan += [(i // per_stage, r, tuple(f"model.layers.{i}.{h}" for h in r.hf))
                     for r in layer_rules(self.arch)]
        plan.append((self.pp - 1, norm, norm.hf))
        if not self.arch.tie_word_embeddings:
            plan += [(self.pp - 1, head, head.hf) for head in heads]
        return plan

    @torch.no_grad()
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` on every rank, one Megatron parameter at a time: the owning stage
        gathers its TP shards and converts them (``to_hf``), then broadcasts to the other stages. A tied
        ``lm_head.weight`` is not yielded (as FSDP2). Every rank must iterate to the end."""
        params = dict(self.model.named_parameters())
        local = {hf_names: name for name, _, hf_names in local_rules(self.model, self.arch)}
        for stage, rule, hf_names in self._export_plan():
            if stage == self.pp_rank:
                shard = params[local[hf_names]].detach()
                parts = [shard]
                if self.tp > 1:
                    parts = [torch.empty_like(shard) for _ in range(self.tp)]
                    dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
                tensors = [t.to(dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)
                           for t in to_hf(rule, parts, self.arch)]
            else:
                tensors = [torch.empty(self._hf_shapes[h], dtype=dtype or torch.float32, device=self.device)
                           for h in hf_names]
            if self.pp > 1:
                for t in tensors:
                    dist.broadcast(t, src=self.pp_ranks[stage], group=self.pp_group)
            yield from zip(hf_names, tensors)

    def _state_names(self) -> dict[str, str]:
        """Checkpoint key of every local parameter: ``tp{rank}.`` + its name with the layer's global index.

        Keys are the same on data-parallel replicas (DCP writes them once) and distinct across TP ranks
        and stages, so a run resumes on another number of DP replicas or PP stages, with the same TP.
        """
        names = {}
        for local, layer in enumerate(self.model.decoder.layers):
            names[f"decoder.layers.{local}."] = f"decoder.layers.{layer.layer_number - 1}."
        out = {}
        for name, _ in self.model.named_parameters():
            key = name
            for local, glob in names.items():
                if name.startswith(local):
                    key = glob + name[len(local):]
                    break
            out[name] = f"tp{self.tp_rank}.{key}"
        return out

    def state_dict(self) -> dict:
        """This rank's shards (+ AdamW moments, scheduler, step) for ``torch.distributed.checkpoint``; a
        fresh engine's state (zero moments) is the load template."""
        keys = self._state_names()
        params = dict(self.model.named_parameters())
        sd: dict = {"model": {keys[n]: p for n, p in params.items()}}
        if self.optimizer is not None:
            optim = {}
            for n, p in params.items():
                state = self.optimizer.state[p]
                if not state:  # AdamW creates its state at the first step; the template needs it now
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                optim[keys[n]] = state
            sd["optim"] = optim
            sd["scheduler"] = self.scheduler.state_dict()
            sd["step"] = self.global_step
        return sd

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        keys = self._state_names()
        for n, p in self.model.named_parameters():
            p.copy_(state["model"][keys[n]])
        if self.optimizer is not None:
            for n, p in self.model.named_parameters():
                saved = state["optim"][keys[n]]
                live = self.optimizer.state[p]
                for k, v in saved.items():
                    if live.get(k) is not v:
                        live[k] = v.clone()
            configured = optimizer_settings(self.optimizer, self.scheduler)
            self.scheduler.load_state_dict(state["scheduler"])
            self._keep_configured(configured)  # also each group's lr at the resumed step
            self.global_step = int(state["step"])
