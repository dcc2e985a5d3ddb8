"""What a Megatron engine needs before its model: quiet imports, Megatron's process groups checked
against spmdrl's training mesh, and a model's architecture read from the config before any work."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from spmdrl.engines.megatron.convert import HFArch
from spmdrl.engines.megatron.cpu import check_version, install_cpu_rng_tracker

if TYPE_CHECKING:
    from spmdrl.parallel import ParallelDims


@contextmanager
def quiet_megatron():
    """Megatron's import-time notices that Apex and Transformer Engine are absent (we use its local layers
    on purpose) and its config's cuda-graph scope deprecation notice (we use no cuda graphs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message=r".*(Apex|Transformer Engine).*(not installed|Falling back)")
        warnings.filterwarnings("ignore", message=r"full scope is deprecated")
        yield


def init_model_parallel(dims: "ParallelDims", device: torch.device, seed: int) -> None:
    """Megatron's process groups for ``dims`` (collective), checked against spmdrl's training mesh.

    Megatron keeps one global set of groups; the actor and reference share it. A different
    layout (tests build several in one process) replaces it. Under split placement the rollout ranks
    take part in making the groups without being in any (``join_as_bystander``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (
            dims.tp, dims.pp)
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        _make_groups(dims)
    mine = sorted(dist.get_process_group_ranks(ps.get_data_parallel_group()))
    here = dims.coords(dist.get_rank())
    ours = [r for r in range(dims.train_ranks)
            if (dims.coords(r)["pp"], dims.coords(r)["tp"]) == (here["pp"], here["tp"])]
    if mine != ours:
        raise RuntimeError(f"Megatron's data-parallel group {mine} is not spmdrl's {ours}")
    if device.type == "cpu":
        check_version()
        install_cpu_rng_tracker(seed, ps.get_tensor_model_parallel_rank())
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def join_as_bystander(dims: "ParallelDims") -> None:
    """(a split placement's rollout ranks; collective with ``init_model_parallel`` on the training ranks)
    Take part in making Megatron's groups, a member of none: torch makes a group on every rank of the
    world, in the same order, or the ranks' later groups no longer match."""
    _make_groups(dims)


def _make_groups(dims: "ParallelDims") -> None:
    """``initialize_model_parallel`` over the training ranks [0, dims.train_ranks) (every rank colocated).

    Megatron lays its groups out over ``torch.distributed.get_world_size()`` ranks; under split placement
    the training ranks are the world's first ones, so it is told that many for the call (the groups it
    makes are then exactly theirs; torch's own group creation counts the real world from its default group).
    """
    from megatron.core import parallel_state as ps

    real = dist.get_world_size

    def train_world(group: dist.ProcessGroup | None = None) -> int:
        return dims.train_ranks if group is None else real(group)

    # Megatron's default order (tp fastest, then dp, then pp) is ParallelDims' row-major train mesh.
    dist.get_world_size = train_world
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp)
    finally:
        dist.get_world_size = real


def model_arch(path: str) -> HFArch | None:
    """The architecture of ``model.path`` before it exists on disk (a built-in model's from its size);
    None for an unknown built-in name, which the config check refuses."""
    if path.startswith("builtin:"):
        from spmdrl.builtin.models import SIZES, check_builtin_model

        try:
            size = SIZES[check_builtin_model(path)[1]]  # a warm start has its base model's size
        except ValueError:
            return None
        return HFArch.from_dict({"model_type": "qwen2", "vocab_size": 1, **size}, path)
    return HFArch.from_folder(path)
