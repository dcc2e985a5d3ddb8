"""The built-in models (``models``) and tasks (``tasks``, ``gsm8k``): built locally on first use, nothing
downloaded. ``resolve_builtins`` turns every ``builtin:`` path of a config into the cached folder or file,
once per run, before anything reads it.

    cfg = resolve_builtins(cfg)     # collective: rank 0 builds what is missing, the others wait
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union

# The submodules are imported where they are used, not here: ``python -m spmdrl.builtin.models`` (and
# ``.tasks``) would otherwise find its own module imported by this package first (runpy's RuntimeWarning).

if TYPE_CHECKING:
    from spmdrl.config import Config


def _model(path: Optional[str]) -> Optional[str]:
    from spmdrl.builtin.models import resolve_builtin_model

    return None if path is None else resolve_builtin_model(path)


def _files(files: Union[str, list[str], None], split: str) -> Union[list[str], None]:
    from spmdrl.builtin.tasks import resolve_builtin_data

    if files is None:
        return None
    return [resolve_builtin_data(f, split) for f in ([files] if isinstance(files, str) else files)]


def check_builtin_names(cfg: "Config") -> None:
    """Every ``builtin:`` model and data name of ``cfg`` is a known one (ValueError listing them); nothing is
    built, so this runs before start-up."""
    from spmdrl.builtin.models import PLAN_ONLY, check_builtin_model
    from spmdrl.builtin.tasks import check_builtin_task

    rm = cfg.reward_model
    for key, path in (("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path),
                      ("critic.model_path", cfg.critic.model_path),
                      ("reward_model.model.path", rm.model.path)):
        if path is not None and path.startswith("builtin:"):
            try:
                _, size, _ = check_builtin_model(path)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
            if size in PLAN_ONLY and not cfg.trainer.plan_only:
                raise ValueError(f"{key} is {path!r}, a model's shape that spmdrl plans for but never "
                                 f"builds; add --trainer.plan_only true, or give a model folder")
    for key in ("train_files", "val_files"):
        files = getattr(cfg.data, key)
        for spec in [files] if isinstance(files, str) else files or []:
            if spec.startswith("builtin:"):
                try:
                    check_builtin_task(spec)
                except ValueError as err:
                    raise ValueError(f"data.{key}: {err}") from None


def resolve_builtins(cfg: "Config") -> "Config":
    """A copy of ``cfg`` whose model folders (policy, tokenizer, critic, reward model) and data files name
    real paths; ``builtin:`` ones are built into the cache on first use. Call on every rank (it holds
    barriers)."""
    rm = cfg.reward_model
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=_model(cfg.model.path),
                                  tokenizer_path=_model(cfg.model.tokenizer_path)),
        critic=dataclasses.replace(cfg.critic, model_path=_model(cfg.critic.model_path)),
        reward_model=dataclasses.replace(rm, model=dataclasses.replace(rm.model, path=_model(rm.model.path))),
        data=dataclasses.replace(cfg.data, train_files=_files(cfg.data.train_files, "train"),
                                 val_files=_files(cfg.data.val_files, "val")),
    )
