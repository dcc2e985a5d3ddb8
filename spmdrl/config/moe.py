"""The checks a Mixture-of-Experts run needs before any work: routing replay, expert parallelism and the
load-balancing loss against the model (dense or MoE), the training engine and the rollout engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.config import Config


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_moe(cfg: "Config") -> None:
    """Routing replay needs a Mixture-of-Experts model and, for R3, a rollout engine that records routes;
    MoE training runs on FSDP2 without TP."""
    from spmdrl.config.shape import ModelShape
    from spmdrl.rollout import rollout_engine_class

    a, r, rc = cfg.actor, cfg.rollout, cfg.algorithm.rollout_correction
    path, ep = cfg.model.path, cfg.parallel.ep
    experts = ModelShape.of(path).experts
    if experts == 0:
        _check(ep == 1, f"parallel.ep is {ep}, but model.path {path!r} is a dense model, which has no "
                        f"experts to split: set parallel.ep: 1")
        _check(a.router_replay == "disabled",
               f"actor.router_replay is {a.router_replay}, but model.path {path!r} is a dense model; routing "
               f"replay needs a Mixture-of-Experts model: set it to disabled")
        _check(a.moe_aux_loss_coef == 0,
               f"actor.moe_aux_loss_coef is {a.moe_aux_loss_coef}, but model.path {path!r} is a dense model, "
               f"which has no router to balance: set it to 0")
        return
    _check(a.strategy == "fsdp2", f"model.path {path!r} is a Mixture-of-Experts model, which actor.strategy "
                                  f"{a.strategy!r} does not train yet; set actor.strategy: fsdp2")
    _check(experts % ep == 0, f"parallel.ep is {ep}, which does not divide the {experts} experts of "
                              f"model.path {path!r}")
    tp = cfg.parallel.tp
    _check(tp == 1, f"model.path {path!r} is a Mixture-of-Experts model with parallel.tp={tp}; its experts "
                    f"are not tensor-parallel yet: set parallel.tp: 1")
    _check(a.router_replay != "R3" or rollout_engine_class(r.engine).records_routes,
           f"actor.router_replay is R3, but rollout.engine {r.engine!r} does not return the experts it "
           f"routed each token to; use rollout.engine native, or R2 (the old-log-prob pass's routing)")
    split_bypass = (r.placement == "split" and r.max_staleness > 0 and not rc.corrects
                    and r.calculate_log_probs)
    _check(a.router_replay != "R2" or not (rc.bypass_mode or split_bypass),
           "actor.router_replay is R2, which replays the old-log-prob pass's routing, but this run takes the "
           "rollout's log-probs as the old ones (rollout_correction.bypass_mode, or split placement at "
           "max_staleness >= 1) and runs no such pass; use R3")
