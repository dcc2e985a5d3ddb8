"""Megatron-core on CPU: the few CUDA assumptions it makes, redirected, only while we call into it.

Megatron-core has no CPU path: a handful of its functions allocate on
``torch.cuda.current_device()`` or on the literal device ``"cuda"``, call
``Tensor.cuda()``, or keep RNG states with ``torch.cuda.get_rng_state``. On a
CUDA machine none of this module is used (``compat_context`` returns a null
context). On CPU (tests, CI on gloo) the Megatron engine wraps every call into
Megatron (model construction, forward, backward, the pipeline schedule) in
``cpu_compat()`` and installs ``CpuRNGStatesTracker`` once. What each piece
redirects, as read in megatron-core 0.16.1 (the version checked; see
``CHECKED_VERSIONS``):

- ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` inside the
  context. Callers: ``RotaryEmbedding.get_emb`` (moves ``inv_freq`` "to the GPU"
  once), ``parallel_state.GlobalMemoryBuffer.get_tensor`` (the attention score
  buffer of ``DotProductAttention.forward``), ``pipeline_parallel.p2p_communication``
  (receive buffers and shape tensors of the pipeline schedule).
- ``torch.cuda.synchronize()`` is a no-op inside the context (CPU ops and gloo's
  isend/irecv waits are already synchronous). Caller:
  ``P2PCommunicator._communicate_shapes`` (with ``variable_seq_lengths``).
- Factory functions called with ``device="cuda"`` allocate on the CPU instead
  (a ``TorchFunctionMode``). Caller: ``schedules.forward_backward_no_pipelining``
  and ``forward_backward_pipelining_without_interleaving``
  (``total_num_tokens = torch.zeros([], device="cuda")``).
- ``Tensor.cuda()`` returns the tensor itself. Caller:
  ``LanguageModule.setup_embeddings_and_output_layer`` (the tied output layer of
  the last pipeline stage, before its all-reduce with the first stage).
- ``tensor_parallel.random``'s RNG tracker: ``CpuRNGStatesTracker`` keeps CPU
  generator states under Megatron's tracker names, so ``fork()`` (entered by
  ``DotProductAttention.forward`` around attention dropout, and by weight init
  outside ``use_cpu_initialization``) swaps CPU RNG states as the CUDA tracker
  swaps CUDA ones: dropout inside TP regions differs per TP rank, reproducibly.

Not redirected here but worked around by the engine: Megatron's TP linear layers
declare ``custom_fwd`` / ``custom_bwd`` for device "cuda" only, so under a CPU
``torch.autocast`` their backward would run without it; the engine keeps the
whole schedule (forward and backward) inside the autocast.

Everything else the engine needs runs unchanged on gloo: ``initialize_model_parallel``,
``GPTModel`` with the local (non-Transformer-Engine) layer spec and
``use_cpu_initialization``, TP linear layers (all-reduce, all-gather), and the
PP schedules with ``batch_p2p_comm=False`` (plain ``isend``/``irecv``). Not
bridged here: Megatron's DDP / distributed optimizer (contiguous grad buffers
on the CUDA device, CUDA streams in
``megatron/core/distributed/param_and_grad_buffer.py``), which the engine does
not use on any device, and sequence parallelism, which the engine does not
implement yet (gloo itself has ``reduce_scatter_tensor`` in torch 2.13).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

# megatron-core releases whose CUDA call sites were read and covered above.
CHECKED_VERSIONS = ("0.16.1",)


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Factory calls with ``device="cuda"`` allocate on the CPU; ``Tensor.cuda()`` is the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Megatron calls made inside run on the CPU (see the module docstring for what is redirected)."""
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with _CudaAllocationsOnCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved  # type: ignore[assignment]


def compat_context(device: torch.device) -> contextlib.AbstractContextManager:
    """``cpu_compat()`` on a CPU device; a null context on CUDA, where Megatron runs as written."""
    return cpu_compat() if device.type == "cpu" else contextlib.nullcontext()


def check_version() -> None:
    """Warn once when the installed megatron-core is not one whose CUDA call sites were checked."""
    import megatron.core

    if megatron.core.__version__ not in CHECKED_VERSIONS:
        warnings.warn(
            f"megatron-core {megatron.core.__version__} on CPU: spmdrl's CPU compatibility was checked with "
            f"{', '.join(CHECKED_VERSIONS)}; a CUDA call it does not redirect would fail with 'Torch not "
            f"compiled with CUDA enabled'",
            stacklevel=2,
        )


def install_cpu_rng_tracker(seed: int, tp_rank: int) -> None:
    """Megatron's RNG tracker on CPU generator states, seeded as ``model_parallel_cuda_manual_seed``
    seeds the CUDA one (data-parallel ``seed``, tensor-parallel ``seed + 2718 + tp_rank``, expert
    ``seed + 1024``)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _tracker_base() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class CpuRNGStatesTracker(_tracker_base()):  # type: ignore[misc]
    """``CudaRNGStatesTracker`` whose named states are CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the CPU tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
