"""Process group start-up and the two device meshes every rank builds once.

Training mesh (FSDP2 / TP / PP), row-major over ranks, dims outermost first:

    pp            pipeline stages; a stage is a contiguous block of ranks
    dp_replicate  HSDP replicas: parameters replicated, gradients all-reduced
    dp_shard      FSDP shards: parameters, gradients and optimizer state sharded
    sp            sequence parallel (verl's Ulysses): the ranks of an SP group
                  run the same rows, each a contiguous slice of every packed
                  sequence; FSDP shards over dp_shard x sp
    tp            tensor parallel: innermost so a TP group is ranks that are
                  neighbours (same node, fastest link)

Rollout mesh (generation), row-major:

    dp            independent engines, each generating its own prompts
    tp            engine-internal tensor parallelism; TP groups are contiguous
                  rank blocks [0..tp-1], [tp..2tp-1], ... because vLLM's
                  external launcher lays ranks out that way

The data-parallel size of the loop is the rollout DP size: each rollout DP
coordinate owns a disjoint share of the prompts, and after generation the
ranks of a TP group each keep 1/tp of the group's outputs, so the batch is
sharded over the whole world in rank order (see docs/design.md, "Meshes").

Split placement (``rollout.placement: split``, ``rollout_ranks`` > 0): the
training mesh covers ranks [0, world - rollout_ranks) and the rollout mesh the
last ``rollout_ranks`` ranks; a rank has one role, and the batch is sharded over
each role's ranks (``spmdrl/split/`` moves it from one to the other).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from spmdrl.config import Config


class RankRole(str, Enum):
    """What a rank does in the run, from its place in the world (``ParallelDims.role``); the one vocabulary
    of the memory plan, the reward sources, the watchdog and the split placement's roles."""

    COLOCATED = "colocated"  # generates and trains, taking turns on its device (no split placement)
    TRAINING = "training"  # split placement: trains the models, sends the weights, keeps the checkpoints
    ROLLOUT = "rollout"  # split placement: generates and scores the batches it sends

    @property
    def trains(self) -> bool:
        return self is not RankRole.ROLLOUT

    @property
    def generates(self) -> bool:
        return self is not RankRole.TRAINING

    @property
    def label(self) -> str:
        """How a message names such a rank's role ("" colocated, where every rank does everything)."""
        return "" if self is RankRole.COLOCATED else self.value


def resolve_device_type(requested: str = "auto") -> str:
    """``auto`` picks cuda when a GPU is visible, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return requested


def init_distributed(device_type: str, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Start the default process group (gloo on CPU; on GPU nccl for CUDA tensors and gloo for CPU ones, so
    the loop's small CPU-tensor collectives (metrics, row counts) and object collectives work on either
    device); returns (rank, world_size).

    Plain ``python -m spmdrl.train`` (no torchrun) runs as a world of one: the
    rendezvous variables torchrun would set are filled in for a single process.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for_rank(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rollout_coords(mesh: Optional[DeviceMesh]) -> tuple[int, int]:
    """(rollout-DP rank, rollout-TP size) of this rank on a rollout mesh; (0, 1) without a mesh.

    The TP axis is the dimension whose name ends in "tp" (or the second of a 2-D
    mesh without names); the DP axis is the other one.
    """
    if mesh is None:
        return 0, 1
    tp_dim = _tp_dim(mesh)
    dp_dim = next((i for i in range(mesh.ndim) if i != tp_dim), None)
    return ((0 if dp_dim is None else mesh.get_local_rank(dp_dim)),
            (1 if tp_dim is None else mesh.size(tp_dim)))


def rollout_tp_rank(mesh: Optional[DeviceMesh]) -> int:
    """This rank's place inside its rollout TP group (0 without a mesh or without TP): which 1/tp share of
    the group's outputs it keeps."""
    if mesh is None or mesh.ndim < 2:
        return 0
    return mesh.get_local_rank(_tp_dim(mesh))


def rollout_tp_group(mesh: Optional[DeviceMesh]) -> tuple[Optional[dist.ProcessGroup], Optional[int]]:
    """This rank's rollout TP group and the global rank of its first rank, the group's leader (an engine
    whose TP ranks are processes of its own is started by the leader alone); (None, None) at TP 1."""
    if rollout_coords(mesh)[1] == 1:
        return None, None
    group = mesh.get_group(_tp_dim(mesh))
    return group, dist.get_global_rank(group, 0)


def _tp_dim(mesh: DeviceMesh) -> Optional[int]:
    """The rollout mesh's TP dimension: the one whose name ends in "tp", else the second of a 2-D mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    return next((i for i, n in enumerate(names) if n.endswith("tp")), 1 if mesh.ndim == 2 else None)


@dataclass
class ParallelDims:
    """The parallel degrees of one run, checked against the world size.

    -1 for ``dp_shard`` means "whatever is left". Build meshes with ``build``.
    """

    world_size: int
    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    rollout_tp: int = 1
    device_type: str = "cpu"
    rollout_ranks: int = 0  # split placement: the last this many ranks only generate (0: colocated)
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg: "Config", world_size: int, **extra) -> "ParallelDims":
        """The degrees of ``cfg`` (parallel.*, and the rollout ranks of a split placement) on ``world_size``
        ranks; raises ValueError (one sentence) when they do not fit."""
        return cls(world_size, **vars(cfg.parallel), rollout_ranks=split_ranks(cfg), **extra)

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "sp", "ep", "rollout_tp"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"parallel.{key} is {value}; it must be an integer >= 1")
        if self.rollout_ranks:
            if not 0 < self.rollout_ranks < self.world_size:
                raise ValueError(
                    f"rollout.placement split puts {self.rollout_ranks} rank(s) on rollout "
                    f"(rollout.nnodes x rollout.n_gpus_per_node), which leaves no rank of the "
                    f"{self.world_size} to train; give rollout fewer ranks than the world")
            self._check_degrees(self.world_size - self.rollout_ranks, "training ranks")
            self._check_rollout(self.rollout_ranks, "rollout ranks")
        else:
            self._check_degrees(self.world_size, "world size")
            self._check_rollout(self.world_size, "world size")
        self._check_ep()

    def _check_ep(self) -> None:
        """Expert parallelism splits the FSDP ranks alone (no HSDP, TP, PP or SP beside it yet)."""
        if self.ep == 1:
            return
        others = {k: getattr(self, k) for k in ("dp_replicate", "tp", "pp", "sp") if getattr(self, k) > 1}
        if others:
            shown = ", ".join(f"parallel.{k}={v}" for k, v in others.items())
            raise ValueError(f"parallel.ep is {self.ep} with {shown}; expert parallelism combines with plain "
                             f"FSDP only (parallel.dp_shard) for now: set those to 1 or parallel.ep to 1")
        if self.dp_shard % self.ep:
            raise ValueError(f"parallel.ep is {self.ep}, which does not divide the {self.dp_shard} FSDP "
                             f"ranks (parallel.dp_shard); an expert-parallel group is ep of them")

    def _check_degrees(self, world_size: int, what: str) -> None:
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp * self.pp * self.sp
            if world_size % rest:
                raise ValueError(
                    f"{what} {world_size} is not divisible by parallel.dp_replicate x tp x pp x sp = "
                    f"{rest}; choose degrees whose product divides the number of ranks"
                )
            self.dp_shard = world_size // rest
        elif self.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard is {self.dp_shard}; it must be >= 1 or -1 (the rest)")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.sp
        if product != world_size:
            raise ValueError(
                f"parallel.pp x dp_replicate x dp_shard x sp x tp = {self.pp} x {self.dp_replicate} x "
                f"{self.dp_shard} x {self.sp} x {self.tp} = {product}, but the {what} is {world_size}; the "
                f"product must equal it"
            )

    def _check_rollout(self, world_size: int, what: str) -> None:
        if world_size % self.rollout_tp:
            raise ValueError(
                f"parallel.rollout_tp is {self.rollout_tp}, which does not divide the {what} {world_size}"
            )

    @property
    def dp(self) -> int:
        """Training data-parallel degree (FSDP shards x HSDP replicas)."""
        return self.dp_replicate * self.dp_shard

    @property
    def split(self) -> bool:
        """Split placement: rollout and training on disjoint ranks."""
        return self.rollout_ranks > 0

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def rollout_dp(self) -> int:
        return (self.rollout_ranks or self.world_size) // self.rollout_tp

    def trains(self, rank: int) -> bool:
        """Whether ``rank`` holds the training engines (every rank when colocated)."""
        return rank < self.train_ranks

    def generates(self, rank: int) -> bool:
        """Whether ``rank`` holds a rollout engine (every rank when colocated)."""
        return not self.split or rank >= self.train_ranks

    def role(self, rank: int) -> RankRole:
        """``rank``'s role: colocated, or under split placement training or rollout."""
        if not self.split:
            return RankRole.COLOCATED
        return RankRole.TRAINING if self.trains(rank) else RankRole.ROLLOUT

    def roles(self) -> list[RankRole]:
        """Every role a rank may have (each its own memory plan)."""
        return [RankRole.TRAINING, RankRole.ROLLOUT] if self.split else [RankRole.COLOCATED]

    def build(self) -> "ParallelDims":
        """Create the named meshes (collective: every rank must call it, whatever its role)."""
        train_shape = (self.pp, self.dp_replicate, self.dp_shard, self.sp, self.tp)
        train_names = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
        if not self.split:
            self._meshes["train"] = init_device_mesh(self.device_type, train_shape,
                                                     mesh_dim_names=train_names)
            self._meshes["rollout"] = init_device_mesh(
                self.device_type, (self.rollout_dp, self.rollout_tp), mesh_dim_names=("dp", "tp")
            )
            return self._flatten_sp()
        ranks = torch.arange(self.world_size)
        self._meshes["train"] = DeviceMesh(self.device_type, ranks[: self.train_ranks].view(train_shape),
                                           mesh_dim_names=train_names)
        self._meshes["rollout"] = DeviceMesh(self.device_type,
                                             ranks[self.train_ranks:].view(self.rollout_dp, self.rollout_tp),
                                             mesh_dim_names=("dp", "tp"))
        # new_group is collective over the world: every rank creates every group, in this order.
        train, rollout = list(range(self.train_ranks)), list(range(self.train_ranks, self.world_size))
        self._groups["train"] = dist.new_group(train)
        # The training ranks' decisions and checkpoints use CPU collectives (NCCL has none).
        self._groups["train_cpu"] = dist.new_group(train, backend="gloo")
        self._groups["rollout"] = dist.new_group(rollout)
        self._groups["weights"] = dist.new_group([0, *rollout])  # train rank 0 sends, rollout ranks receive
        for r in rollout:  # rollout rank r sends its share of each batch to every train rank
            self._groups[f"batch{r}"] = dist.new_group([*train, r])
        return self._flatten_sp()

    def _flatten_sp(self) -> "ParallelDims":
        """The (dp_shard, sp) axes as one, FSDP's under sequence parallelism (``fsdp_mesh``), and the expert
        mesh (``expert_mesh``); made here, where every rank takes part, as a mesh's new groups need."""
        if self.sp > 1:
            self._meshes["train"]["dp_shard", "sp"]._flatten("dp_shard_sp")
        if self.ep > 1:
            ranks = torch.arange(self.train_ranks).view(self.dp_shard // self.ep, self.ep)
            self._meshes["expert"] = DeviceMesh(self.device_type, ranks, mesh_dim_names=("efsdp", "ep"))
        return self

    def group(self, name: str) -> dist.ProcessGroup:
        """A split placement's process group: "train", "train_cpu" (gloo), "rollout",
        "weights", "batch<rollout rank>"."""
        if name not in self._groups:
            raise RuntimeError(f"no process group {name!r}: build() makes them under split placement only")
        return self._groups[name]

    def _mesh(self, name: str) -> DeviceMesh:
        if name not in self._meshes:
            raise RuntimeError("ParallelDims.build() must be called before its meshes are used")
        return self._meshes[name]

    @property
    def train_mesh(self) -> DeviceMesh:
        return self._mesh("train")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel mesh (ranks that hold different rows): 1-D dp_shard, or 2-D (dp_replicate,
        dp_shard) for HSDP. Counts and loss metrics are summed over it."""
        mesh = self.train_mesh
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh FSDP2 shards over: ``dp_mesh``, with its dp_shard axis flattened with sp under sequence
        parallelism (an SP group's ranks hold the same rows but different tokens, so their gradients are
        summed as FSDP sums a shard's)."""
        if self.sp == 1:
            return self.dp_mesh
        mesh = self.train_mesh
        return mesh["dp_replicate", "dp_shard_sp"] if self.dp_replicate > 1 else mesh["dp_shard_sp"]

    @property
    def expert_mesh(self) -> Optional[DeviceMesh]:
        """Expert parallelism's 2-D mesh of the FSDP ranks (``parallel.ep``): ``ep`` (consecutive ranks that
        split a layer's experts) x ``efsdp`` (the ranks owning the same experts, which FSDP shards them over);
        None without EP (engines/fsdp2/expert_parallel.py)."""
        return self._meshes["expert"] if self.ep > 1 else None

    @property
    def sp_mesh(self) -> Optional[DeviceMesh]:
        return self.train_mesh["sp"] if self.sp > 1 else None

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return self.train_mesh["tp"] if self.tp > 1 else None

    @property
    def rollout_mesh(self) -> DeviceMesh:
        return self._mesh("rollout")

    @property
    def batch_group(self) -> dist.ProcessGroup:
        """The group batch-wide statistics reduce over: every rank, because the batch is sharded over the
        whole world in rollout order (whatever the training mesh); under split placement, this rank's
        role's ranks, over which that role's batch is sharded. Passed explicitly, never as None."""
        if not self.split:
            return dist.group.WORLD
        return self.group("train" if self.trains(dist.get_rank()) else "rollout")

    def coords(self, rank: int) -> dict[str, Optional[int]]:
        """Coordinates of ``rank`` on both meshes (for the start-up summary line); None on a mesh the rank
        is not on (split placement)."""
        pp, rest = divmod(rank, self.dp_replicate * self.dp_shard * self.sp * self.tp)
        rep, rest = divmod(rest, self.dp_shard * self.sp * self.tp)
        shard, rest = divmod(rest, self.sp * self.tp)
        sp, tp = divmod(rest, self.tp)
        rdp, rtp = divmod(rank - (self.train_ranks if self.split else 0), self.rollout_tp)
        train = dict(pp=pp, dp_replicate=rep, dp_shard=shard, sp=sp, tp=tp) if self.trains(rank) else \
            dict.fromkeys(("pp", "dp_replicate", "dp_shard", "sp", "tp"))
        rollout = dict(rollout_dp=rdp, rollout_tp=rtp) if self.generates(rank) else \
            dict.fromkeys(("rollout_dp", "rollout_tp"))
        return {**train, **rollout}


def split_ranks(cfg: "Config") -> int:
    """Ranks that only generate under ``rollout.placement: split`` (rollout.nnodes x n_gpus_per_node, verl's
    keys); 0 when colocated."""
    r = cfg.rollout
    if r.placement != "split":
        return 0
    return r.nnodes * (r.n_gpus_per_node or 0)


def gather_bytes(data: bytes, group: dist.ProcessGroup, device: torch.device | str = "cpu") -> list[bytes]:
    """Every rank's ``data``, on every rank: lengths first, then equal-sized uint8 tensors on ``device`` (the
    group's backend's), so nothing is pickled."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.long, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    most = max(int(n) for n in lengths)
    mine = torch.zeros(most, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [bytes(p[:int(n)].cpu().tolist()) for p, n in zip(parts, lengths)]
