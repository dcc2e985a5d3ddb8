"""The import hook that bridges SGLang's CUDA-only kernel package on CPU (spmdrl/rollout/sglang_cpu.py), used
here without installing it in this process: a stand-in ``sgl_kernel`` only where no real one exists, whose
names raise if called and which lacks every other name, so SGLang's ImportError fallbacks are taken."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest

from spmdrl.rollout import sglang_cpu


def test_stand_in_kernel_module_raises_when_called():
    if importlib.machinery.PathFinder.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed here")
    spec = sglang_cpu._Hook().find_spec("sgl_kernel", None)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SPMDRL_CPU_STUB and set(sglang_cpu.CPU_KERNEL_NAMES) <= set(vars(module))
    with pytest.raises(NotImplementedError, match="sgl_kernel.assign_req_to_token_pool_cpu is not available"):
        module.assign_req_to_token_pool_cpu()
    assert not hasattr(module, "rmsnorm")  # `from sgl_kernel import rmsnorm` fails: SGLang's fallback runs


def test_a_real_kernel_package_and_other_modules_are_left_alone(monkeypatch):
    real = importlib.machinery.PathFinder.find_spec
    found = lambda name, path=None, target=None: object() if name == "sgl_kernel" else real(name, path)  # noqa: E731
    monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", found)
    hook = sglang_cpu._Hook()
    assert hook.find_spec("sgl_kernel", None) is None  # the real one is found by the normal import
    assert hook.find_spec("json", None) is None
    # torchvision whose ops loaded: nothing is defined
    monkeypatch.setitem(sys.modules, "torchvision.extension", types.SimpleNamespace(_has_ops=lambda: True))
    assert hook.find_spec("torchvision._meta_registrations", None) is None and not sglang_cpu._libraries


def test_install_is_idempotent(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert not sglang_cpu.installed()
    sglang_cpu.install()
    sglang_cpu.install()
    assert sglang_cpu.installed() and sum(type(f).__name__ == "_Hook" for f in sys.meta_path) == 1
