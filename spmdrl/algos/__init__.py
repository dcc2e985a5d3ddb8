"""Pure algorithm functions: advantage estimators, policy/value losses, KL estimators, DAPO helpers.

Importing the package fills the registries in ``spmdrl.algos.registry``; the
loop looks every algorithm up there by its config name.
"""

from spmdrl.algos import advantages, dapo, kl, losses  # noqa: F401  (imported to register)
from spmdrl.algos.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    get_advantage,
    get_kl,
    get_loss_agg,
    get_policy_loss,
)

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "advantages",
    "dapo",
    "get_advantage",
    "get_kl",
    "get_loss_agg",
    "get_policy_loss",
    "kl",
    "losses",
]
