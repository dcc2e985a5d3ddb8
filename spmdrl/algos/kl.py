"""KL(actor || reference) estimators, KL coefficient controllers, and the in-reward KL penalty.

Estimators take per-token log-probs of the sampled tokens and return a per-token
estimate ``[B, T]`` (see http://joschu.net/blog/kl-approx.html):

- ``kl`` / ``k1``: logp - ref_logp. Unbiased, high variance, can be negative.
- ``abs``: |logp - ref_logp|.
- ``mse`` / ``k2``: 0.5 * (logp - ref_logp)^2. Biased, low variance; its
  gradient is the gradient of the true KL in expectation.
- ``low_var_kl`` / ``k3``: exp(d) - d - 1 with d = ref_logp - logp. Unbiased,
  low variance, never negative.
- ``<name>+``: the value of ``<name>`` with the gradient of k2, by the
  straight-through construction ``k2 - sg(k2) + sg(<name>)``: k1 and k3 as a
  *loss* give biased KL gradients, k2's gradient is the right one.

The actor's KL loss uses ``actor.kl_loss_type``; the in-reward penalty uses
``algorithm.kl_penalty`` with a coefficient from a controller
(``algorithm.kl_ctrl``).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from spmdrl.algos.registry import get_kl, register_kl
from spmdrl.algos.utils import all_reduce_sum

# exp(d) overflows float32 near d = 88; clamping d first keeps the value and,
# more importantly, the gradient finite (a clamped inf would back-propagate NaN).
K3_LOG_RATIO_CLAMP = 20.0
# k3 estimates from single tokens explode when the policies disagree a lot;
# bounding each token's estimate keeps one token from dominating the loss.
K3_VALUE_CLAMP = 10.0


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp  # [B, T]


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()  # [B, T]


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()  # [B, T]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # [B, T]
    return (torch.exp(d) - d - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _straight_through_k2(estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    def fn(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        grad_term = kl_k2(logp, ref_logp)  # [B, T]
        return grad_term - grad_term.detach() + estimator(logp, ref_logp).detach()

    fn.__name__ = f"{estimator.__name__}_plus"
    fn.__doc__ = f"Value of {estimator.__name__}, gradient of k2."
    return fn


_BASE = {"kl": kl_k1, "k1": kl_k1, "abs": kl_abs, "mse": kl_k2, "k2": kl_k2, "low_var_kl": kl_k3, "k3": kl_k3}
for _name, _fn in _BASE.items():
    register_kl(_name)(_fn)
    register_kl(f"{_name}+")(_straight_through_k2(_fn))


class FixedKLController:
    """A constant KL coefficient: the configured one, also after a resume."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; kept so the loop treats both controllers alike."""

    def state_dict(self) -> dict[str, Union[float, str]]:
        return {"type": "fixed", "kl_coef": self.value, "value": self.value}

    def load_state_dict(self, state: dict[str, Union[float, str]]) -> None:
        """Nothing to restore: a changed ``algorithm.kl_ctrl.kl_coef`` applies, and rank 0 says so."""
        saved = float(state["value"])
        if state.get("type", "fixed") != "fixed":
            _say(f"algorithm.kl_ctrl.type: {state['type']} in the checkpoint (coefficient {saved:.6g}) -> "
                 f"fixed configured, kl_coef {self.value}")
        elif saved != self.value:
            _say(f"algorithm.kl_ctrl.kl_coef: {saved} in the checkpoint -> {self.value} configured")


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019): steer the measured KL towards ``target_kl``.

    The proportional error is clipped to +-20% so one noisy batch cannot swing
    the coefficient; ``n_steps / horizon`` sets how fast it moves. ``n_steps``
    is the number of responses (prompts x n) in the batch, as verl's trainer
    passes it, so ``horizon`` is counted in responses too. A resume continues
    from the saved coefficient, unless the configured starting value changed.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target_kl > 0 and horizon > 0 "
                f"(algorithm.kl_ctrl), got target_kl={target_kl}, horizon={horizon}"
            )
        self.init = self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Union[float, str]]:
        return {"type": "adaptive", "kl_coef": self.init, "value": self.value}

    def load_state_dict(self, state: dict[str, Union[float, str]]) -> None:
        """The saved coefficient; a checkpoint of a fixed controller, or one started from another
        ``algorithm.kl_ctrl.kl_coef``, restarts from the configured value instead (rank 0 says so).
        ``target_kl`` and ``horizon`` are always the configured ones."""
        saved_type, saved_init = state.get("type", "adaptive"), state.get("kl_coef")
        if saved_type != "adaptive":
            _say(f"algorithm.kl_ctrl.type: {saved_type} in the checkpoint -> adaptive configured: the "
                 f"coefficient starts from kl_coef {self.init}")
        elif saved_init is not None and float(saved_init) != self.init:
            _say(f"algorithm.kl_ctrl.kl_coef: {saved_init} in the checkpoint -> {self.init} configured: the "
                 f"adaptive coefficient restarts from it (it was at {float(state['value']):.6g})")
        else:
            self.value = float(state["value"])


def _say(line: str) -> None:
    """One line about a resumed setting, from rank 0 (as the engines report optimizer settings)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[checkpoint] {line}", flush=True)


KLController = Union[FixedKLController, AdaptiveKLController]


def build_kl_controller(
    type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """Controller from ``algorithm.kl_ctrl`` (its fields are exactly these arguments)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(
        f"unknown KL controller {type!r} (config key algorithm.kl_ctrl.type); valid names: adaptive, fixed"
    )


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,  # [B, T]
    logp: torch.Tensor,  # [B, T] log-probs of the policy that sampled (old_logp)
    ref_logp: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    kl_coef: float,
    kl_penalty: str = "kl",
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards minus ``kl_coef`` times the per-token KL estimate (zero on padding).

    The metric ``actor/reward_kl_penalty`` is the batch mean over responses of
    each response's token-mean KL, all-reduced over ``group``: the number an
    adaptive controller should be updated with, identical on every rank so the
    ranks' coefficients never drift apart.
    """
    m = mask.to(token_rewards.dtype)
    kl = get_kl(kl_penalty)(logp, ref_logp) * m  # [B, T]
    has_tokens = (m.sum(-1) > 0).to(m.dtype)  # [B]
    seq_kl = kl.sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    totals = all_reduce_sum(torch.stack([seq_kl.sum(), has_tokens.sum()]), group)  # [2]: sum, responses
    batch_kl = float((totals[0] / totals[1].clamp(min=1)).item())
    metrics = {"actor/reward_kl_penalty": batch_kl, "actor/reward_kl_penalty_coeff": float(kl_coef)}
    return token_rewards - kl_coef * kl, metrics
