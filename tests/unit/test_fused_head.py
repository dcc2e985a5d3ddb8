"""The FSDP2 engine's fused LM head against the plain path it replaced (whole logits, log_softmax, autograd)
on one rank in float32: forward_no_grad's log-probs and entropies and one train_step's updated weights, at
temperature 0.7, with and without an entropy bonus, tied and untied heads, packed sequences and LoRA; and
a LoRA adapter on lm_head refused in one sentence."""

from __future__ import annotations

import pytest
import torch
from plain_logprobs import plain_head
from rows import fsdp2_engine, pg_loss, rows_with_lengths

from spmdrl.errors import ConfigError

pytestmark = pytest.mark.usefixtures("gloo_world_of_one")

PROMPT, RESP = [9, 2, 6, 1, 9, 4], [8, 1, 5, 2, 8, 3]  # long and short rows: padding everywhere


def bonus_loss(outputs, mb, scale):
    """pg_loss minus an entropy bonus: the entropy's gradient flows."""
    mask = mb["response_mask"]
    loss = -((outputs["logp"] * mb["advantages"] + 0.1 * outputs["entropy"]) * mask).sum()
    loss = loss / scale.global_tokens
    return loss, {"actor/pg_loss": loss.item()}


CASES = {  # name: (untied model, engine keywords, loss)
    "tied": (False, {}, pg_loss),
    "untied_bonus": (True, {}, bonus_loss),
    "packed_bonus": (False, dict(remove_padding=True), bonus_loss),
    "untied_packed": (True, dict(remove_padding=True), pg_loss),
    "lora": (False, dict(lora="spec"), pg_loss),
}


def _trained(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone()
            for n, p in engine.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_head_equals_the_plain_path(case, tiny_model_dir, untied_model_dir):
    from spmdrl.engines.fsdp2.lora import LoraSpec

    untied, kw, loss = CASES[case]
    if kw.get("lora"):
        kw = dict(lora=LoraSpec(rank=8, alpha=16.0))
    model_dir = untied_model_dir if untied else tiny_model_dir
    batch = rows_with_lengths(PROMPT, RESP, 2048, seed=3)
    mask = batch["response_mask"]

    def run():
        engine = fsdp2_engine(model_dir, temperature=0.7, **kw)
        before = _trained(engine)
        out = engine.forward_no_grad(batch, 4, with_entropy=True)
        engine.train_step(batch, loss, mini_batch_size=6, micro_batch_size=4, entropy_grad=loss is bonus_loss)
        return out, before, _trained(engine)

    fused_out, before, fused = run()
    with plain_head():
        plain_out, _, plain = run()
    for k in ("logp", "entropy"):
        assert float(((fused_out[k] - plain_out[k]) * mask).abs().max()) < 1e-5, k
    assert max(float((fused[n] - plain[n]).abs().max()) for n in plain) < 1e-5
    assert max(float((fused[n] - before[n]).abs().max()) for n in plain) > 5e-5  # the step moved them


def test_an_adapter_on_lm_head_is_refused(tiny_model_dir):
    from spmdrl.config import Config
    from spmdrl.engines.fsdp2.engine import FSDP2Engine
    from spmdrl.engines.fsdp2.lora import LoraSpec

    cfg = Config()
    cfg.model.lora_rank, cfg.model.target_modules = 8, ["q_proj", "lm_head"]
    with pytest.raises(ValueError, match="model.target_modules .* lm_head"):
        FSDP2Engine.check_config(cfg)
    cfg.model.target_modules = "all-linear"  # peft leaves the output layer out of all-linear
    FSDP2Engine.check_config(cfg)
    with pytest.raises(ConfigError, match="leave lm_head out of model.target_modules"):
        fsdp2_engine(tiny_model_dir, lora=LoraSpec(rank=8, alpha=16.0, target_modules=["lm_head"]))
