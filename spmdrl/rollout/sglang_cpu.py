"""SGLang on CPU torch from PyPI: two packages it imports that do not load there, bridged at import time.

Loaded at the start of every Python process of ``.venv-sglang`` by a ``.pth`` file that ``.ci/sglang-venv``
writes (it links this file into the venv as ``spmdrl_sglang_cpu``), because SGLang runs its scheduler and
detokenizer in spawned child processes, which import SGLang afresh and must get the same bridges. At
start-up it only adds an import hook (``install``): no torch import, nothing else changes. What the hook
bridges, as read in sglang 0.5.17 and torchvision 0.28.0 (``CHECKED_VERSIONS``):

- ``sgl_kernel``: SGLang's CPU path imports these names from SGLang's kernel package at module level
  (``if _is_cpu: from sgl_kernel import ...``) in its KV-cache allocator, cache mover and speculative
  decoding modules: ``CPU_KERNEL_NAMES``. The CPU build of that package is not on PyPI (source build only)
  and the PyPI ``sglang-kernel`` wheel is CUDA-only. A dense model with the ``torch_native`` attention
  backend calls none of them (they serve the Intel AMX backend and speculative decoding, neither of
  which the rollout engine turns on), so when no real ``sgl_kernel`` is installed the hook provides a
  module whose names raise ``NotImplementedError`` if ever called; any other name is missing, so
  SGLang's own ``try: from sgl_kernel import ... except ImportError`` fallbacks are taken. SGLang then
  also sees no ``torch.ops.sgl_kernel.convert_weight_packed`` and keeps its AMX backend off.
- ``torchvision``: the only torchvision 0.28.0 wheel on PyPI is built against CUDA; its C++ ops do not
  load on CPU torch (torchvision warns and goes on without them), but its ``_meta_registrations`` then
  registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` and fails on the missing op
  schemas, so ``import torchvision`` raises. SGLang imports torchvision unconditionally (image
  processors, and transformers when it finds it installed). When torchvision's ops did not load, the
  hook defines the two schemas (no kernel: calling them raises) right before that module runs. Text-only
  rollouts never call them.

On a machine where the real packages load (``sglang-kernel`` on CUDA, a torchvision matching torch) the
hook does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

CHECKED_VERSIONS = {"sglang": ("0.5.17",), "torchvision": ("0.28.0",)}
# Imported from sgl_kernel under ``if _is_cpu`` in sglang 0.5.17 (8 at module import of a dense model's
# path; the AMX backend and EAGLE-3 modules import the other two).
CPU_KERNEL_NAMES = (
    "assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
    "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu", "rotate_input_ids_cpu",
    "build_draft_decode_metadata_cpu",
)
# torchvision's C++ schemas of the two ops that torchvision/_meta_registrations.py registers fake kernels
# for by name.
TORCHVISION_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                       "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_libraries: list = []  # torch.library.Library objects: a definition lives as long as its Library


def _missing_kernel(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available: spmdrl's CPU stand-in for SGLang's "
                                  f"kernel package (spmdrl/rollout/sglang_cpu.py) has no kernels")
    kernel.__name__ = name
    return kernel


class _StubKernelLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.update({n: _missing_kernel(n) for n in CPU_KERNEL_NAMES})
        module.SPMDRL_CPU_STUB = True


class _Hook(importlib.abc.MetaPathFinder):
    """Provides the ``sgl_kernel`` stand-in and the torchvision schemas (see the module docstring)."""

    def find_spec(self, name, path, target=None):
        if name == "sgl_kernel" and importlib.machinery.PathFinder.find_spec(name) is None:
            return importlib.util.spec_from_loader(name, _StubKernelLoader())
        if name == "torchvision._meta_registrations":
            ext = sys.modules.get("torchvision.extension")
            if ext is not None and not ext._has_ops():
                _define_torchvision_schemas()
        return None  # the normal import goes on


def _define_torchvision_schemas() -> None:
    import torch

    if _libraries or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in TORCHVISION_SCHEMAS:
        lib.define(schema)
    _libraries.append(lib)


def install() -> None:
    """Add the import hook once per process (the .pth file calls this at interpreter start)."""
    if not installed():
        sys.meta_path.insert(0, _Hook())


def installed() -> bool:
    """Whether this process has the hook (it does in .venv-sglang; elsewhere SGLang must load as is)."""
    return any(type(f).__name__ == "_Hook" and type(f).__module__ in ("spmdrl_sglang_cpu", __name__)
               for f in sys.meta_path)
