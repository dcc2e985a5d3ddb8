"""Decorator registries for the pure algorithm functions.

    @register_advantage("grpo")
    def grpo_advantage(token_rewards, response_mask, index, *, ...): ...

    fn = get_advantage("grpo")        # unknown names list the valid ones
    ADVANTAGES.meta("gae")            # {"needs_values": True, "needs_baseline": False}

The loop looks algorithms up here by the name in the config and never branches
on names itself.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions of one kind (advantage estimators, policy losses, ...)."""

    def __init__(self, kind: str, config_key: str, meta_defaults: Optional[Mapping[str, Any]] = None) -> None:
        self.kind = kind
        self.config_key = config_key
        # Metadata keys this registry knows, with the value an entry gets when it
        # does not say; a key outside this table is a typo and fails at import.
        self._meta_defaults: dict[str, Any] = dict(meta_defaults or {})
        self._fns: dict[str, Callable] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        unknown = sorted(set(meta) - set(self._meta_defaults))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown metadata {unknown}; "
                f"known keys: {sorted(self._meta_defaults) or 'none'}"
            )

        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._fns[name] = fn
            self._meta[name] = {**self._meta_defaults, **meta}
            return fn

        return deco

    def _check(self, name: str) -> None:
        if name not in self._fns:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key {self.config_key}); "
                f"valid names: {', '.join(sorted(self._fns))}"
            )

    def get(self, name: str) -> Callable:
        self._check(name)
        return self._fns[name]

    def meta(self, name: str) -> dict[str, Any]:
        """What the loop must supply for ``name`` (a copy: every known key, defaults filled in)."""
        self._check(name)
        return dict(self._meta[name])

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns


# needs_values: the estimator reads a critic's values (the loop must run the critic).
# needs_baseline: the estimator reads a per-prompt baseline reward (ReMax's greedy rollout).
ADVANTAGES = Registry(
    "advantage estimator",
    "algorithm.adv_estimator",
    meta_defaults={"needs_values": False, "needs_baseline": False},
)
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
