"""Dtypes by name, and what this machine runs natively: the ``auto`` precision and the fast-path checks.

    dtype = resolve_dtype("auto", "cpu")          # bfloat16 where it is native, else float32
    ok, why = native_bf16("cpu")                  # (False, "this CPU has no native bf16 ...")

Why it matters: on a CPU without native bf16 (AVX2 only, e.g. AMD Zen 1-3)
oneDNN emulates bf16 matmuls at about 1/40 of the float32 rate and refuses to
prepack bf16 weights, so ``auto`` picks float32 there and an explicit
``bfloat16`` still runs (each fast path checks what it needs) with one warning.

Native bf16 means: CUDA with ``torch.cuda.is_bf16_supported()``; on CPU, what
oneDNN reports through ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
(x86 avx512_core and up, or AArch64 bf16), unless the oneDNN ISA is capped
below AVX-512 by ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``). That cap is
how CI hides AVX-512 on a machine that has it; it is read here as well so the
decision flips whether or not torch's own check honours it.
"""

from __future__ import annotations

import functools
import os

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
# Short spellings accepted where people type dtypes by hand (benchmarks, engine arguments).
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which bf16 is emulated or refused: below avx512_core,
# except avx2_vnni_2, whose AVX-NE-CONVERT oneDNN uses for bf16.
_ISA_WITHOUT_BF16 = ("sse41", "avx", "avx2", "avx2_vnni", "avx512_mic", "avx512_mic_4ops")
# What a bf16 matmul costs without native support (measured: 256^3 bf16 20 ms vs ~0.5 ms fp32 on Zen).
EMULATED_BF16_SLOWDOWN = "about 40x slower than float32"


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its config name ("float32", "bfloat16", "float16"; also "fp32", "bf16", "fp16")."""
    if isinstance(name, torch.dtype):
        return name
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not valid; valid: {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def onednn_isa_cap() -> str:
    """The oneDNN ISA cap from the environment, lower-cased ('' when none is set)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().lower()


@functools.lru_cache(maxsize=None)
def _native_bf16(device_type: str, cap: str) -> tuple[bool, str]:
    if device_type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "the GPU supports bf16"
        return False, "the GPU has no native bf16"
    if device_type != "cpu":
        return False, f"unknown device type {device_type!r}"
    if cap in _ISA_WITHOUT_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={cap.upper()} caps oneDNN below AVX-512"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN"
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    if native:
        return True, "oneDNN reports native bf16 on this CPU"
    return False, "oneDNN reports no native bf16 on this CPU (no AVX-512)"


def native_bf16(device_type: str) -> tuple[bool, str]:
    """Whether ``device_type`` ("cpu" or "cuda") computes in bf16 natively, and why (for logs)."""
    return _native_bf16(device_type, onednn_isa_cap() if device_type == "cpu" else "")


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """A config dtype with ``auto`` decided: bfloat16 where the device runs it natively, else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device_type)[0] else torch.float32
    return to_dtype(name)


def precision_summary(compute: str, rollout: str, device_type: str) -> tuple[str, bool]:
    """One line naming the resolved compute and rollout dtypes and why, and whether bf16 will be emulated.

    ``compute`` and ``rollout`` are the config values (``actor.param_dtype`` and
    ``rollout.dtype``, possibly ``auto``).
    """
    native, why = native_bf16(device_type)
    c, r = resolve_dtype(compute, device_type), resolve_dtype(rollout, device_type)
    auto = [k for k, v in (("compute", compute), ("rollout", rollout)) if v == "auto"]
    reason = "auto" if len(auto) == 2 else f"{auto[0]} auto" if auto else "as configured"
    reason = f"{reason}: {why}"
    emulated = not native and torch.bfloat16 in (c, r)
    return f"precision: compute {dtype_name(c)}, rollout {dtype_name(r)} ({reason})", emulated


@functools.lru_cache(maxsize=None)
def _prepack_works(dtype: torch.dtype) -> bool:
    """Run oneDNN's prepack and packed linear once on a small weight; any error means no."""
    g = torch.Generator().manual_seed(0)  # its own stream: the run's global RNG is left as it was
    try:
        w = torch.randn(32, 32, generator=g).to(dtype)
        x = torch.randn(4, 32, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), (x @ w.t()).float(), rtol=2e-2, atol=2e-2))
    except (AttributeError, RuntimeError):
        return False


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN weight prepacking serves ``dtype`` on ``device``.

    Needs a CPU, a torch built with oneDNN (x86 builds; not every aarch64 one),
    float32, or bfloat16 on a CPU with native bf16 (without it oneDNN refuses:
    "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and
    avx512dq"), and a probe that packs and multiplies a small matrix.
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16 and not native_bf16("cpu")[0]:
        return False
    return _prepack_works(dtype)
