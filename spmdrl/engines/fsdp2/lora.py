"""LoRA adapters on an FSDP2 engine's model, through peft (verl's ``lora_rank`` / ``lora_alpha`` / ...).

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear")
    scaling = add_adapters(model, spec)          # before TP, checkpointing, compile and fully_shard
    with adapters_disabled(model): ...           # the base model: the reference policy, no second copy
    merge_adapters(engine.export_weights_raw(), scaling)   # merged HF weights for the rollout engine

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a ``lora.Linear`` holding
the frozen ``base_layer`` and the trainable ``lora_A`` / ``lora_B`` (B starts at zero, so the adapted
model starts equal to the base). The module tree keeps its Hugging Face layout, so FSDP2's per-layer
wrapping and the HF names of everything else are unchanged. Only adapter parameters (and a critic's value
head) require gradients, so only they get AdamW state and go into checkpoints.

An adapter folder (``lora_adapter_path``) is read as PEFT writes one: ``adapter_config.json`` (r, lora_alpha,
target_modules) and ``adapter_model.safetensors``; nothing pickled is ever loaded.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import torch
import torch.nn as nn

from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.batch import Batch

ADAPTER = "default"  # peft's adapter name; PEFT folders store keys without it
PEFT_PREFIX = "base_model.model."  # how a PEFT folder names the wrapped model's parameters
Modules = Union[str, list[str], None]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: Modules = "all-linear"
    exclude_modules: Modules = None
    adapter_path: Optional[str] = None


def lora_spec(model_cfg: Any) -> Optional[LoraSpec]:
    """The actor's LoRA from the ``model`` config section (None: full fine-tuning). An adapter folder turns
    LoRA on by itself, with its own rank."""
    m = model_cfg
    if m.lora_rank <= 0 and not m.lora_adapter_path:
        return None
    return LoraSpec(max(m.lora_rank, 1), m.lora_alpha, m.target_modules, m.exclude_modules,
                    m.lora_adapter_path)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapts_lm_head(target_modules: Modules, exclude_modules: Modules = None) -> bool:
    """Whether peft would put an adapter on the module named ``lm_head`` (by its own matching rules)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=target_modules, exclude_modules=exclude_modules)
    hit = check_target_module_exists(config, "lm_head")  # True, a regex match, or a falsy / excluded marker
    return hit is True or isinstance(hit, re.Match)


def read_adapter_config(path: str) -> dict:
    """r, lora_alpha and target_modules of the PEFT folder ``path``; ConfigError naming what is missing."""
    folder = Path(path)
    config, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise ConfigError(f"lora_adapter_path {path!r} must be a PEFT adapter folder with "
                          f"adapter_config.json and adapter_model.safetensors (adapter_model.bin, pickled, "
                          f"is not read)")
    try:
        data = json.loads(config.read_text())
        out = {"r": int(data["r"]), "lora_alpha": float(data["lora_alpha"]),
               "target_modules": data["target_modules"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{str(config)!r} is not a LoRA adapter config (needs r, lora_alpha and "
                          f"target_modules): {err}") from None
    if out["r"] < 1:
        raise ConfigError(f"{str(config)!r} has r={out['r']}; a LoRA rank must be >= 1")
    return out


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int, trainable_prefixes: tuple[str, ...] = ()
                 ) -> dict[str, float]:
    """Inject LoRA into ``model`` in place, load ``spec.adapter_path`` if given, and leave only adapters
    (and parameters named with ``trainable_prefixes``, e.g. a value head) trainable. Returns each adapted
    module's scaling (alpha / r) by its name, for ``merge_adapters``."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    if spec.adapter_path:
        saved = read_adapter_config(spec.adapter_path)
        spec = replace(spec, rank=saved["r"], alpha=saved["lora_alpha"],
                       target_modules=saved["target_modules"])
    from transformers import PreTrainedModel

    # A value model wraps the HF backbone: "all-linear" is resolved by peft on a PreTrainedModel only.
    target = model if isinstance(model, PreTrainedModel) else model.model
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules,
                        exclude_modules=spec.exclude_modules, lora_dropout=0.0, bias="none")
    # A is drawn at random: every rank must draw the same, since each keeps its own shard of its own draw.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, target)
    if spec.adapter_path:
        _load_adapter(model, target, spec.adapter_path)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.startswith(trainable_prefixes))
    scaling = {name: float(m.scaling[ADAPTER])
               for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not scaling:
        raise ConfigError(f"target_modules {spec.target_modules!r} matched no linear layer of the model")
    return scaling


def _load_adapter(model: nn.Module, target: nn.Module, path: str) -> None:
    """A PEFT folder's A and B matrices into the injected adapters (shapes checked, keys must all match)."""
    from safetensors.torch import load_file

    prefix = "" if target is model else "model."
    ours = dict(model.named_parameters())
    loaded = load_file(str(Path(path) / "adapter_model.safetensors"))
    for key, tensor in loaded.items():
        name = prefix + key.removeprefix(PEFT_PREFIX).replace(".weight", f".{ADAPTER}.weight")
        if name not in ours or ours[name].shape != tensor.shape:
            raise ConfigError(f"lora_adapter_path {path!r}: tensor {key!r} {list(tensor.shape)} matches no "
                              f"adapter of this model (r and target_modules must be the adapter's)")
        with torch.no_grad():
            ours[name].copy_(tensor)
    missing = [n for n in ours if is_adapter(n) and n.removeprefix(prefix) not in {
        k.removeprefix(PEFT_PREFIX).replace(".weight", f".{ADAPTER}.weight") for k in loaded}]
    if missing:
        raise ConfigError(f"lora_adapter_path {path!r} has no tensor for {missing[0]!r}")


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward inside the block. peft's own switch (``enable_adapters(False)``) also turns
    ``requires_grad`` off, which FSDP2 reads when it first unshards a parameter: were that the reference
    pass, the adapters would never get gradients. So only the flag that ``forward`` reads is set."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


class AdaptersOff:
    """The reference policy of a LoRA engine: its no-grad forward with the adapters off (what the loop
    calls on a reference engine)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def forward_no_grad(self, batch: "Batch", micro_batch_size: int, with_entropy: bool = False,
                        max_token_len: Optional[int] = None) -> dict[str, torch.Tensor]:
        with adapters_disabled(self.engine.model):
            return self.engine.forward_no_grad(batch, micro_batch_size, with_entropy, max_token_len)


def merge_adapters(weights: Iterator[tuple[str, torch.Tensor]], scaling: dict[str, float]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF weights from an adapted model's parameter stream: each ``X.base_layer.weight`` with its
    ``X.lora_A/B`` becomes ``X.weight = W + scaling * B @ A`` (computed in float32, returned in W's dtype),
    ``X.base_layer.bias`` becomes ``X.bias``; everything else passes through. peft registers base_layer
    before lora_A and lora_B, so at most one module's tensors wait at a time."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf != "weight":
                yield f"{module}.{leaf}", t
                continue
            pending.setdefault(module, {})["W"] = t
        elif is_adapter(name):
            module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]  # "A" or "B"
            pending.setdefault(module, {})[kind] = t
        else:
            yield name, t
            continue
        parts = pending[module]
        if len(parts) == 3:
            del pending[module]
            w = parts["W"].float() + scaling[module] * (parts["B"].float() @ parts["A"].float())
            yield f"{module}.weight", w.to(parts["W"].dtype)


def peft_state(weights: Iterator[tuple[str, torch.Tensor]], prefix: str = "") -> dict[str, torch.Tensor]:
    """Adapter tensors under the names a PEFT folder uses (``base_model.model.<module>.lora_A.weight``);
    ``prefix`` is dropped first (a value model's ``model.``)."""
    return {PEFT_PREFIX + n.removeprefix(prefix).replace(f".{ADAPTER}.weight", ".weight"): t
            for n, t in weights if is_adapter(n)}
