"""FSDP2 training engine: actor, frozen reference, critic and frozen reward model on a Hugging Face model.

One ``FSDP2Engine`` per role, built identically on every rank of the training
mesh (SPMD). The model is loaded from an HF folder (the critic and reward model
wrapped by ``models.py``), then parallelised by the functions of
``parallelize.py`` in their fixed order (TP, activation checkpointing, compile,
FSDP), and trained with AdamW by ``TrainEngine.train_step``, whose hooks this
file fills: a forward and backward per micro-batch, and ``weights.clip_grad_norm_``.

    actor = FSDP2Engine(path, role="actor", dp_mesh=mesh["dp_shard"], tp_mesh=None,
                        device=torch.device("cpu"), lr=1e-5)
    logp = actor.forward_no_grad(batch, micro_batch_size=8)["logp"]        # [N, R]
    metrics = actor.train_step(batch, loss_fn, mini_batch_size=8, micro_batch_size=4)

Positions: for ``input_ids`` [N, P+R] and ``response_mask`` [N, R], the model's
outputs at positions P-1 .. P+R-2 predict the response tokens P .. P+R-1, so
``logp[:, j]`` scores response token j and ``values[:, j]`` is the value of the
state before it (the same positions as the actor's log-probs). The actor's and
reference's ``lm_head`` is the fused log-prob head (``lm_head.py``): the HF
forward at those positions ends in log-probs and entropy, never in logits.

Gradient scaling: a loss function divides its local sum by the global count of
the mini-batch (``LossScale``), so the true gradient is the SUM over DP ranks
of the local gradients. FSDP's reduce-scatter AVERAGES over the DP group, so
the engine back-propagates ``loss * dp_size``; the optimizer then sees exactly
the gradient a single rank would compute on the whole mini-batch.

Data layout: the batch given to the engine holds this rank's rows (sharded
over the whole world). With train TP > 1 the ranks of a TP group hold
different rows but must run the same forward, so the engine all-gathers the
rows of its TP group (per mini-batch in training; the whole batch for
no-grad forwards, then keeps this rank's rows of the result).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from spmdrl.batch import Batch
from spmdrl.engines.base import LossFn, LossScale, ModelRole, TrainEngine, zero_loss
from spmdrl.engines.fsdp2.expert_parallel import apply_ep
from spmdrl.engines.fsdp2.fused import apply_fused_kernels, resolve_fused_kernels
from spmdrl.engines.fsdp2.lm_head import install_fused_head
from spmdrl.engines.fsdp2.lora import (
    AdaptersOff,
    LoraSpec,
    adapts_lm_head,
    add_adapters,
    lora_spec,
    merge_adapters,
    read_adapter_config,
)
from spmdrl.engines.fsdp2.models import RewardModel, ValueModel
from spmdrl.engines.fsdp2.moe import install_routing
from spmdrl.engines.fsdp2.packing import Packed, pack, packed_attention, shard_packed
from spmdrl.engines.fsdp2.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_tp,
)
from spmdrl.engines.fsdp2.ulysses import gather_seq, shard_attention
from spmdrl.engines.fsdp2.weights import clip_grad_norm_, hf_name, iter_full_state, iter_unsharded_state
from spmdrl.engines.optim import build_optimizer, build_scheduler, optimizer_settings
from spmdrl.precision import resolve_dtype, to_dtype

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

FROZEN = ("ref", "reward")  # roles without optimizer or gradients


def resolve_attn_implementation(name: str, device_type: str, max_len: int) -> str:
    """The config's ``model.attn_implementation``, with "auto" decided by device and sequence length.

    On CPU transformers' eager attention (matmul + float32 softmax) runs forward+backward of an RL
    micro-batch (64 x 85 tokens, bf16) in 13 ms against 42 ms for sdpa's CPU flash kernel; its
    O(length^2) score tensor is why long sequences still go to sdpa.
    """
    if name != "auto":
        return name
    return "eager" if device_type == "cpu" and max_len <= 2048 else "sdpa"


def resolve_compile(setting: bool | str, device_type: str) -> bool:
    """The config's ``model.use_torch_compile``, with "auto" on for CUDA training and off elsewhere."""
    return device_type == "cuda" if setting == "auto" else bool(setting)


def _mixed_precision(role: ModelRole, dtype: torch.dtype, param_dtype: torch.dtype | str | None,
                     reduce_dtype: torch.dtype | str | None
                     ) -> tuple[torch.dtype, torch.dtype | None, torch.dtype | None]:
    """(weight dtype, FSDP ``param_dtype``, FSDP ``reduce_dtype``) of a ``role`` model whose master weights
    are ``dtype``; a policy dtype of None is no cast."""
    # A policy dtype equal to the master dtype is no cast at all: pass None so FSDP skips the copies.
    mp_param = None if param_dtype is None or to_dtype(param_dtype) == dtype else to_dtype(param_dtype)
    mp_reduce = None if reduce_dtype is None or to_dtype(reduce_dtype) == dtype else to_dtype(reduce_dtype)
    if role in FROZEN and mp_param is not None:
        # A frozen model needs no float32 master copy: keep it in the compute dtype, which is
        # what the policy's per-forward cast would produce, at half the memory and no cast.
        return mp_param, None, mp_reduce
    return dtype, mp_param, mp_reduce


class FSDP2Engine(TrainEngine):
    """One sharded model and (for actor/critic) its AdamW optimizer and LR schedule.

    Args:
        model_path: Hugging Face model folder.
        role: "actor" (causal LM, trained), "ref" (causal LM, frozen, no optimizer),
            "critic" (backbone + value head, trained) or "reward" (sequence-classification reward
            model, frozen).
        dp_mesh: the data-parallel mesh (ranks with different rows), 1-D, or 2-D ("dp_replicate", "dp_shard")
            for HSDP: counts and loss metrics are summed over it.
        tp_mesh: TP mesh from the same parent mesh as ``dp_mesh``, or None.
        sp_mesh: SP mesh (Ulysses, ``ulysses.py``), or None: its ranks gather their rows, as a TP group's,
            and each runs 1/sp of every packed row (packing whatever ``remove_padding`` says).
        fsdp_mesh: what FSDP shards over (``dp_mesh`` when None; ``ParallelDims.fsdp_mesh``: dp x sp).
        expert_mesh: an MoE model's expert parallelism (``ParallelDims.expert_mesh``, expert_parallel.py).
        device: where micro-batches and compute live (cpu, or this rank's cuda device).
        dtype: master weight dtype (the loaded weights and optimizer state).
        param_dtype / reduce_dtype: FSDP2 MixedPrecisionPolicy (compute / grad-reduction dtypes).
        cpu_offload: FSDP2 CPUOffloadPolicy (sharded params, grads and optimizer state on the CPU).
        gradient_checkpointing: recompute each decoder layer in backward (not for "ref").
        compile: torch.compile each decoder layer.
        fused_kernels: compiled RMSNorm and SwiGLU forwards (``fused.apply_fused_kernels``).
        attn_implementation: transformers' attention kernel ("eager", "sdpa", ...); see
            ``resolve_attn_implementation`` for the "auto" rule of the config.
        remove_padding: every forward runs on the valid tokens of its micro-batch packed into one
            row (``packing.py``), with ``attn_implementation`` as the attention kernel.
        temperature: logits are divided by it before log-probs and entropy, so the
            actor scores responses with the distribution the rollout sampled from.
        lr, weight_decay, betas, lr_warmup_steps, lr_scheduler, min_lr_ratio, total_steps:
            AdamW and ``optim.WarmupSchedule``.
        max_grad_norm: clip threshold (0: no clipping; the norm is reported either way).
        seed: initialises the critic's value head (the same on every rank).
        router_replay: an MoE model's routing replay (``moe.py``): "R3" replays the batch's
            ``routed_experts`` (the rollout's) in every actor and reference forward; "R2" records them in
            the actor's no-grad forward (``forward_no_grad`` returns them) and replays them in its update;
            "disabled" routes every forward by its own router.
        moe_aux_loss_coef: weight of an MoE model's load-balancing loss in the update (``moe.py``).
    """

    strategy = "fsdp2"

    def __init__(
        self,
        model_path: str,
        *,
        role: ModelRole,
        dp_mesh: DeviceMesh,
        tp_mesh: DeviceMesh | None = None,
        sp_mesh: DeviceMesh | None = None,
        fsdp_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        cpu_offload: bool = False,
        gradient_checkpointing: bool = False,
        compile: bool = False,
        fused_kernels: bool = False,
        attn_implementation: str = "sdpa",
        max_position_embeddings: Optional[int] = None,
        remove_padding: bool = False,
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
        lora: LoraSpec | None = None,
        router_replay: Literal["disabled", "R2", "R3"] = "disabled",
        moe_aux_loss_coef: float = 0.0,
    ):
        if role not in ("actor", "ref", "critic", "reward"):
            raise ValueError(f"engine role {role!r} is not valid; valid: actor, ref, critic, reward")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts score at 1)")
        self.role, self.dp_mesh = role, dp_mesh
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.sp_group = sp_mesh.get_group() if sp_mesh is not None and sp_mesh.size() > 1 else None
        self.fsdp_mesh = fsdp_mesh if fsdp_mesh is not None else dp_mesh
        self.device, self.temperature = torch.device(device), temperature
        # SP slices the packed row: it packs whatever the config says (the padded path's results, 1e-5).
        if (remove_padding := remove_padding or self.sp_group is not None):
            attn_implementation = packed_attention(attn_implementation)
        self.remove_padding, self.max_grad_norm, self.global_step = remove_padding, max_grad_norm, 0
        dtype, mp_param, mp_reduce = _mixed_precision(role, to_dtype(dtype), param_dtype, reduce_dtype)
        # The dtype of the unsharded parameters in forward (what an all-gather produces).
        self.param_dtype = mp_param or dtype
        self.model = self._load(model_path, role, dtype, seed, attn_implementation, max_position_embeddings)
        self.routing = install_routing(self.model)  # an MoE model's routers (None for a dense model)
        self.router_replay, self.moe_aux_loss_coef = router_replay, moe_aux_loss_coef
        if self.sp_group is not None:
            shard_attention(self.model, self.sp_group, f"the {role} model {model_path!r}")
        if role in FROZEN:
            self.model.requires_grad_(False)
        # LoRA goes in first: TP, checkpointing, compile and FSDP then wrap the adapted modules.
        self.lora_scaling: dict[str, float] = {}
        if lora is not None:
            self.lora_scaling = add_adapters(self.model, lora, seed, ("score.",) if role == "critic" else ())
        if role in ("actor", "ref"):  # the forward ends in log-probs, never in [tokens x vocab] logits
            install_fused_head(self.model)
        self.expert_mesh = expert_mesh if self.routing is not None else None
        self._parallelize(gradient_checkpointing and role not in FROZEN, fused_kernels, compile,
                          MixedPrecisionPolicy(param_dtype=mp_param, reduce_dtype=mp_reduce), cpu_offload)

        self.optimizer: torch.optim.AdamW | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if role not in FROZEN:
            self.optimizer = build_optimizer(self.model, lr, weight_decay, betas)
            self.scheduler = build_scheduler(self.optimizer, lr_warmup_steps, lr_scheduler, min_lr_ratio,
                                             total_steps)

    def _parallelize(self, checkpointing: bool, fused_kernels: bool, compile: bool, mp: MixedPrecisionPolicy,
                     cpu_offload: bool) -> None:
        """Expert and tensor parallelism, activation checkpointing, fused kernels, compile, then FSDP: the
        order parallelize.py gives."""
        if self.expert_mesh is not None:
            apply_ep(self.model, self.expert_mesh)
        if self.tp_mesh is not None:
            apply_tp(self.model, self.tp_mesh)
        if checkpointing:
            apply_activation_checkpointing(self.model)
        if fused_kernels:
            apply_fused_kernels(self.model)
        if compile:
            apply_compile(self.model)
        apply_fsdp(self.model, self.fsdp_mesh, mp.param_dtype, mp.reduce_dtype, cpu_offload, self.expert_mesh)

    @staticmethod
    def _load(model_path: str, role: ModelRole, dtype: torch.dtype, seed: int, attn: str,
              positions: Optional[int] = None) -> nn.Module:
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

        # Every rank loads the full weights on the CPU; fully_shard then keeps only its shard on the device.
        if role == "reward":
            return RewardModel(AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, dtype=dtype, attn_implementation=attn))
        # model.max_position_embeddings: a config.json value overridden at load (transformers' kwargs).
        kw = dict(dtype=dtype, attn_implementation=attn, **({"max_position_embeddings": positions}
                                                            if positions else {}))
        if role == "critic":
            return ValueModel(AutoModel.from_pretrained(model_path, **kw), seed)
        return AutoModelForCausalLM.from_pretrained(model_path, **kw)

    @classmethod
    def check_config(cls, cfg: "Config") -> None:
        p = cfg.parallel
        if p.pp > 1:
            raise ValueError(f"parallel.pp is {p.pp} but actor.strategy 'fsdp2' has no pipeline schedule; "
                             f"set parallel.pp: 1, or actor.strategy: megatron")
        for key, on in (("model.use_remove_padding", cfg.model.use_remove_padding),
                        ("critic.use_remove_padding", cfg.critic.use_remove_padding),
                        ("reward_model.model.use_remove_padding", cfg.reward_model.model.use_remove_padding)):
            if on and cfg.model.attn_implementation == "flash_attention_2":
                raise ValueError(f"{key} is true with model.attn_implementation 'flash_attention_2'; packed "
                                 f"sequences run on eager or sdpa attention: set it to auto, eager or sdpa")
        if p.tp > 1 and (lora_spec(cfg.model) or cfg.critic.lora_rank > 0):
            raise ValueError(f"LoRA (model.lora_rank / critic.lora_rank) with parallel.tp={p.tp}: adapters "
                             f"are not tensor-parallel yet; set parallel.tp: 1 (FSDP still shards the base)")
        spec = lora_spec(cfg.model)
        if spec is not None:
            key, targets = "model.target_modules", spec.target_modules
            if spec.adapter_path:
                key, targets = "model.lora_adapter_path's target_modules", \
                    read_adapter_config(spec.adapter_path)["target_modules"]
            if adapts_lm_head(targets, spec.exclude_modules):
                raise ValueError(f"{key} {targets!r} puts a LoRA adapter on lm_head, but the fused log-prob "
                                 f"kernel reads the LM head as one plain weight; leave lm_head out of it")
        if p.sp > 1 and p.tp > 1:
            raise ValueError(f"parallel.sp is {p.sp} with parallel.tp={p.tp}; sequence and tensor "
                             f"parallelism do not combine yet: set one of them to 1")
        if cfg.model.fused_kernels == "on" and p.tp > 1:
            raise ValueError(f"model.fused_kernels is 'on' with parallel.tp={p.tp}; the fused kernels do not "
                             f"support tensor parallelism: set model.fused_kernels to auto or off")

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
    ) -> "FSDP2Engine":
        """Build a role's engine from the run config (``model_path`` already resolved from ``builtin:``)
        on the FSDP mesh (or HSDP mesh) and TP mesh of ``dims``."""
        a, m = cfg.actor, cfg.model
        tp_mesh = dims.tp_mesh
        common = dict(
            role=role,
            dp_mesh=dims.dp_mesh,
            tp_mesh=tp_mesh,
            sp_mesh=dims.sp_mesh,
            fsdp_mesh=dims.fsdp_mesh,
            expert_mesh=dims.expert_mesh,
            device=device,
            dtype=m.dtype,
            param_dtype=resolve_dtype(a.param_dtype, torch.device(device).type),
            reduce_dtype=a.reduce_dtype,
            attn_implementation=resolve_attn_implementation(
                m.attn_implementation, torch.device(device).type,
                cfg.data.max_prompt_length + cfg.data.max_response_length,
            ),
            compile=resolve_compile(m.use_torch_compile, torch.device(device).type),
            max_position_embeddings=m.max_position_embeddings,
            fused_kernels=resolve_fused_kernels(
                m.fused_kernels, torch.device(device).type, tp_mesh.size() if tp_mesh is not None else 1
            ),
            seed=cfg.trainer.seed,
            temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            router_replay=a.router_replay,
        )
        if role == "ref":
            return cls(model_path, cpu_offload=cfg.ref.offload, remove_padding=m.use_remove_padding, **common)
        if role == "reward":
            # The reward model is its own folder: the policy's position override is not its.
            return cls(model_path, remove_padding=cfg.reward_model.model.use_remove_padding,
                       **{**common, "max_position_embeddings": None})
        if role == "critic":
            c = cfg.critic
            return cls(
                c.model_path or model_path,
                cpu_offload=a.cpu_offload,
                gradient_checkpointing=m.enable_gradient_checkpointing is True,
                lr=c.lr,
                weight_decay=c.weight_decay,
                lr_warmup_steps=c.lr_warmup_steps,
                total_steps=total_steps,
                max_grad_norm=c.max_grad_norm,
                remove_padding=c.use_remove_padding,
                lora=LoraSpec(c.lora_rank, c.lora_alpha, c.target_modules) if c.lora_rank > 0 else None,
                **common,
            )
        return cls(
            model_path,
            cpu_offload=a.cpu_offload,
            gradient_checkpointing=m.enable_gradient_checkpointing is True,
            lr=a.lr,
            weight_decay=a.weight_decay,
            betas=tuple(a.betas),
            lr_warmup_steps=a.lr_warmup_steps,
            lr_scheduler=a.lr_scheduler,
            min_lr_ratio=a.min_lr_ratio,
            total_steps=total_steps,
            max_grad_norm=a.max_grad_norm,
            remove_padding=m.use_remove_padding,
            lora=lora_spec(m),
            moe_aux_loss_coef=a.moe_aux_loss_coef,
            **common,
        )

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model; tied weights counted once."""
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ data parallelism

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    @property
    def dp_rank(self) -> int:
        rank = 0
        for dim in range(self.dp_mesh.ndim):  # HSDP: (replicate, shard) coordinates, row-major
            rank = rank * self.dp_mesh.size(dim) + self.dp_mesh.get_local_rank(dim)
        return rank

    @property
    def dp_groups(self) -> list[dist.ProcessGroup]:
        return [self.dp_mesh.get_group(dim) for dim in range(self.dp_mesh.ndim)]

    @property
    def _replica_group(self) -> dist.ProcessGroup | None:
        """The TP group, or the SP group (whose ranks run the same rows too); never both (check_config)."""
        if self.sp_group is not None:
            return self.sp_group
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    def _micro_batches(self, batch: Batch, micro_batch_size: int, max_token_len: int | None
                       ) -> tuple[list[Batch], int]:
        # A token budget is per rank: an SP group's micro-batch spreads over its ranks (verl multiplies
        # ppo_max_token_len_per_gpu by the SP size).
        sp = 1 if self.sp_group is None else dist.get_world_size(self.sp_group)
        return super()._micro_batches(batch, micro_batch_size, max_token_len and max_token_len * sp)

    # ------------------------------------------------------------------ forward

    def _forward(self, micro: Batch, with_entropy: bool, entropy_grad: bool = False, *,
                 training: bool = False, observe: bool = False) -> dict[str, torch.Tensor]:
        """Per-response-token outputs of one micro-batch (on ``self.device``).

        The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus);
        otherwise it is a metric computed in the same pass as the log-probs. An MoE model routes as
        ``router_replay`` says for a ``training`` (update) or no-grad forward, counts its routing when
        ``observe``, and returns what it recorded as ``routed_experts`` [n, P+R, L, k].
        """
        if self.routing is None:
            return self._forward_model(micro, with_entropy, entropy_grad)
        record = self.routing.begin_micro(micro, self.remove_padding, self.sp_group, role=self.role,
                                          replay=self.router_replay, training=training, observe=observe,
                                          balance=training and self.moe_aux_loss_coef > 0)
        out = self._forward_model(micro, with_entropy, entropy_grad)
        self.routing.end()  # a recompute in the backward routes as this forward did, counting nothing
        if record:
            out["routed_experts"] = self.routing.recorded_rows(micro, self.remove_padding, self.sp_group)
        return out

    def _forward_model(self, micro: Batch, with_entropy: bool, entropy_grad: bool) -> dict[str, torch.Tensor]:
        if self.remove_padding:
            return self._forward_packed(micro, with_entropy, entropy_grad)
        ids = micro["input_ids"]  # [n, P+R]
        kwargs = dict(
            input_ids=ids, attention_mask=micro["attention_mask"], position_ids=micro["position_ids"]
        )
        if self.role == "reward":
            return {"rm_scores": self.model(**kwargs).float()}  # [n]
        resp = micro["response_mask"].shape[1]
        if self.role == "critic":
            values = self.model(**kwargs, values_to_keep=resp + 1)  # [n, R+1]
            return {"values": values[:, :-1].float()}
        # The LM head runs only on the R positions that predict response tokens (not on the
        # prompt, not past the end).
        keep = torch.arange(ids.shape[1] - resp - 1, ids.shape[1] - 1, device=ids.device)
        with self.model.lm_head.scoring(ids[:, -resp:], self.temperature, with_entropy, entropy_grad):
            return self.model(**kwargs, use_cache=False, logits_to_keep=keep).logits  # [n, R] each

    def _forward_packed(self, micro: Batch, with_entropy: bool, entropy_grad: bool
                        ) -> dict[str, torch.Tensor]:
        """``_forward`` on the micro-batch's valid tokens packed into one row (``packing.pack``); the
        outputs come back in the padded [n, R] layout."""
        packed = pack(micro)
        if self.sp_group is not None:
            return self._forward_sp(micro, packed, with_entropy, entropy_grad)
        kwargs = packed.model_kwargs()
        if self.role == "reward":
            return {"rm_scores": self.model(**kwargs, last=packed.last).float()}  # [n]
        n, resp = micro["response_mask"].shape
        if self.role == "critic":
            return {"values": self.model(**kwargs, values_to_keep=packed.keep).view(n, resp).float()}
        labels = micro["input_ids"][:, -resp:]  # [n, R], scored from the hidden states [1, n*R, H]
        with self.model.lm_head.scoring(labels, self.temperature, with_entropy, entropy_grad):
            return self.model(**kwargs, use_cache=False, logits_to_keep=packed.keep).logits  # [n, R] each

    def _forward_sp(self, micro: Batch, packed: Packed, with_entropy: bool, entropy_grad: bool
                    ) -> dict[str, torch.Tensor]:
        """``_forward_packed`` on this rank's slice of the packed row (``ulysses.py``): per-token outputs at
        every position of the slice, gathered over the SP group, then read at the row's output positions."""
        group = self.sp_group
        local, targets = shard_packed(packed, group)
        kwargs = local.model_kwargs()
        every = torch.arange(local.input_ids.shape[1], device=local.input_ids.device)  # [T/sp]
        if self.role == "reward":
            scores = self.model(**kwargs, last=every).float()  # [T/sp]
            return {"rm_scores": gather_seq(scores, group)[packed.last]}  # [n]
        n, resp = micro["response_mask"].shape
        if self.role == "critic":
            values = self.model(**kwargs, values_to_keep=every).float()  # [T/sp]
            return {"values": gather_seq(values, group)[packed.keep].view(n, resp)}
        with self.model.lm_head.scoring(targets, self.temperature, with_entropy, entropy_grad):
            out = self.model(**kwargs, use_cache=False, logits_to_keep=0).logits  # [1, T/sp] each
        return {k: gather_seq(v[0], group)[packed.keep].view(n, resp) for k, v in out.items()}

    def forward_no_grad(
        self, batch: Batch, micro_batch_size: int, with_entropy: bool = False,
        max_token_len: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """{"logp", optional "entropy"} (actor/ref) or {"values"} (critic), each [N, R], or {"rm_scores"} [N]
        (reward); float32 on the batch's device, for this rank's rows.
        """
        self._check_rows(len(batch))
        full = self._gather(batch)
        self.model.eval()
        micros, n_pad = self._micro_batches(full, micro_batch_size, max_token_len)
        with torch.no_grad():
            parts = [self._forward(micro.to(self.device), with_entropy) for micro in micros]
            for _ in range(n_pad):  # the all-gathers of the ranks with more micro-batches
                self._forward(micros[0].select(slice(0, 1)).to(self.device), with_entropy)
        # Without a backward the root keeps its unsharded parameters after forward; free them now.
        self.model.reshard()
        out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        routes = out.pop("routed_experts", None)  # [N', P'+R', L, k] of the gathered rows (R2)
        out = self._own_rows(out, batch)
        if routes is not None:  # this rank's rows, cut from the replica's widths back to its own
            (P, R), (P_all, _) = batch.widths, full.widths
            start = dist.get_rank(self._replica_group) * len(batch) if self._replica_group is not None else 0
            routes = routes[start:start + len(batch), P_all - P:P_all + R]
            out["routed_experts"] = routes.to(batch["input_ids"].device)
        return out

    # ------------------------------------------------------------------ training

    def _forward_backward(self, micros: list[Batch], loss_fn: LossFn, scale: LossScale, with_entropy: bool,
                          entropy_grad: bool) -> list[dict[str, float]]:
        """One forward and backward per micro-batch; FSDP reduce-scatters the gradients in the backward."""
        metrics = []
        for micro in micros:
            # A padding micro-batch (zero_loss) repeats a real row: its routing is not counted.
            outputs = self._forward(micro, with_entropy, entropy_grad, training=True,
                                    observe=loss_fn is not zero_loss)
            loss, m = loss_fn(outputs, micro, scale)
            if self.routing is not None and self.routing.aux_loss is not None:  # moe_aux_loss_coef > 0
                share = float(micro["response_mask"].sum()) / scale.global_tokens
                aux = self.routing.weighted_aux_loss(share, int(micro["attention_mask"].sum()))
                loss = loss + self.moe_aux_loss_coef * aux
                m = {**m, "actor/moe/aux_loss": float(self.routing.aux_loss.detach())}
            # FSDP averages gradients over its mesh; loss_fn already divided by global counts. Under SP the
            # mesh is dp x sp and each SP rank's gradient is its tokens' share: a sum over the mesh too.
            (loss * self.fsdp_mesh.size()).backward()
            metrics.append(m)
        return metrics

    def _clip_grads(self) -> float:
        return clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def _step_metrics(self, prefix: str) -> dict[str, float]:
        """An MoE model's expert load and router agreement over this step's update forwards."""
        if self.routing is None:
            return {}
        groups = self.dp_groups + ([self.sp_group] if self.sp_group is not None else [])
        return self.routing.metrics(groups, f"{prefix}/moe", self._comm_device())

    # ------------------------------------------------------------------ weights, memory, checkpoints

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)``, one parameter gathered at a time, optionally cast to ``dtype``.

        Names are the HF state-dict names. A tied ``lm_head.weight`` is NOT
        yielded (only ``model.embed_tokens.weight``): consumers re-tie from the
        HF config's ``tie_word_embeddings``. Every rank must iterate to the end
        (each tensor is an all-gather over the training mesh).
        """
        self.model.reshard()
        whole_units = self.tp_mesh is None and self.expert_mesh is None  # no DTensor left after an unshard
        if whole_units and dtype is not None and dtype == self.param_dtype:
            # FSDP gathers whole units in the compute dtype: the cast the consumer asked for.
            weights = iter_unsharded_state(self.model)
        else:
            weights = iter_full_state(self.model, dtype)
        yield from merge_adapters(weights, self.lora_scaling) if self.lora_scaling else weights

    def base_reference(self) -> "AdaptersOff | None":
        """With LoRA, the reference policy is this model with its adapters off (no second copy)."""
        return AdaptersOff(self) if self.lora_scaling else None

    def state_dict(self) -> dict:
        """Sharded model (+ optimizer, scheduler, step) for ``torch.distributed.checkpoint.save/load``.

        The optimizer part initialises Adam's state first when it is empty (so a
        fresh engine can serve as the load template).
        """
        # With LoRA only the adapters (and a value head) are saved: the base is model.path's.
        sd: dict = {"model": get_model_state_dict(self.model, options=self._state_options)}
        if self.lora_scaling:  # a tied LM head is listed although its weight (the embeddings) is frozen
            trainable = {hf_name(n) for n, p in self.model.named_parameters() if p.requires_grad}
            sd["model"] = {k: v for k, v in sd["model"].items() if k in trainable}
        if self.optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
            sd["scheduler"] = self.scheduler.state_dict()
            sd["step"] = self.global_step
        return sd

    @property
    def _state_options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=bool(self.lora_scaling), strict=not self.lora_scaling)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=self._state_options)
        if self.optimizer is not None:
            configured = optimizer_settings(self.optimizer, self.scheduler)
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            self.scheduler.load_state_dict(state["scheduler"])
            self._keep_configured(configured)
            self.global_step = int(state["step"])
