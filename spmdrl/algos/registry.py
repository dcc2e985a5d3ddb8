"""Decorator registries for the pure algorithm functions.

    @register_advantage("grpo")
    def grpo_advantage(token_rewards, response_mask, index, *, ...): ...

    fn = get_advantage("grpo")        # unknown names list the valid ones

The loop looks algorithms up here by the name in the config and never branches
on names itself.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions of one kind (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._fns: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable:
        if name not in self._fns:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key {self.config_key}); "
                f"valid names: {', '.join(sorted(self._fns))}"
            )
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns


ADVANTAGES = Registry("advantage estimator", "algorithm.adv_estimator")
POLICY_LOSSES = Registry("policy loss", "actor.policy_loss")
KL_ESTIMATORS = Registry("KL estimator", "actor.kl_loss_type / algorithm.kl_penalty")
LOSS_AGG_MODES = Registry("loss aggregation mode", "actor.loss_agg_mode")

register_advantage = ADVANTAGES.register
register_policy_loss = POLICY_LOSSES.register
register_kl = KL_ESTIMATORS.register
register_loss_agg = LOSS_AGG_MODES.register


def get_advantage(name: str) -> Callable:
    return ADVANTAGES.get(name)


def get_policy_loss(name: str) -> Callable:
    return POLICY_LOSSES.get(name)


def get_kl(name: str) -> Callable:
    return KL_ESTIMATORS.get(name)


def get_loss_agg(name: str) -> Callable:
    return LOSS_AGG_MODES.get(name)
