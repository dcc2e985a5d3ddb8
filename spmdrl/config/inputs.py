"""Checks of the run's parquet files before any work: every row in verl's layout, a scorer for every row's
``data_source``, a ground truth wherever the rule reward needs one, and a chat template where chat prompts
or tool calls need it. A file that would train on silently wrong data (every reward 0) stops here, with one
sentence naming the file, the row and the key, instead of on every rank after the models have loaded.

    check_data_files(cfg)       # ConfigError; ``builtin:`` tasks are spmdrl's own and skipped

Rows are read in full (four small columns); tokenising them waits for ``spmdrl.data`` after start-up.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from spmdrl.config.sections import Config
from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")


def _user_files(files: Any) -> list[str]:
    files = [files] if isinstance(files, str) else list(files or [])
    return [f for f in files if not f.startswith("builtin:")]


def check_data_files(cfg: Config) -> None:
    """Every user parquet file of ``data.train_files`` and ``data.val_files``; raises ConfigError."""
    from spmdrl.data import read_rows

    rm = cfg.reward_model
    rule = not (rm.enable and rm.rule_weight == 0)  # else the reward model's score replaces the rule score
    scorer = rule and cfg.reward.function == "builtin"
    chat, train_rows = False, 0
    for key in ("train_files", "val_files"):
        for path in _user_files(getattr(cfg.data, key)):
            try:
                rows = read_rows(path, cfg.data.prompt_key)
            except ValueError as err:
                raise ConfigError(f"data.{key}: {err}") from None
            if scorer:
                _check_sources(rows["data_source"], path, key)
            if rule:
                _check_ground_truths(rows["reward_model"], path, key, required=scorer,
                                     function=cfg.reward.function)
            chat = chat or any(isinstance(p, list) for p in rows["prompt"])
            train_rows += len(rows["prompt"]) if key == "train_files" else 0
    train = cfg.data.train_files
    if not any(f.startswith("builtin:") for f in ([train] if isinstance(train, str) else train)):
        if train_rows < cfg.data.draw_size:
            raise ConfigError(f"data.train_files hold {train_rows} rows, fewer than {cfg.data.draw_key} "
                              f"({cfg.data.draw_size}); one generation round needs that many prompts")
    if cfg.rollout.multi_turn.enable or (chat and cfg.data.apply_chat_template):
        _check_chat_template(cfg, "rollout.multi_turn.enable is true" if cfg.rollout.multi_turn.enable
                             else "the data files hold chat-message prompts")


def _check_sources(sources: list, path: str, key: str) -> None:
    """A built-in scorer for every row's data_source (reward.function builtin picks it by that name)."""
    from spmdrl.reward.scorers import SCORERS

    for i, source in enumerate(sources):
        if source not in SCORERS:
            what = "has no data_source" if source is None else f"has data_source {source!r}"
            raise ConfigError(f"data.{key}: row {i} of {path!r} {what}, which no built-in scorer handles "
                              f"(reward.function=builtin); known data sources: {', '.join(sorted(SCORERS))}; "
                              f"or set reward.function to path/to/file.py:function")


def _check_ground_truths(reward_models: list, path: str, key: str, *, required: bool, function: str) -> None:
    """reward_model.ground_truth on every row: the built-in scorers compare with it (a row without one
    would score 0 on every response); a user's function gets None and may not need it, so that is a
    warning, given once."""
    missing = [i for i, r in enumerate(reward_models)
               if not isinstance(r, dict) or r.get("ground_truth") is None]
    if not missing:
        return
    if required:
        raise ConfigError(f"data.{key}: row {missing[0]} of {path!r} has no reward_model.ground_truth "
                          f"({len(missing)} of {len(reward_models)} rows lack one); the built-in scorers "
                          f"compare responses with it, so every such response would score 0")
    if os.environ.get("RANK", "0") == "0":
        log.warning("data.%s: %d of %d rows of %r have no reward_model.ground_truth (first: row %d); "
                    "reward.function %s receives ground_truth=None for them", key, len(missing),
                    len(reward_models), path, missing[0], function)


def _check_chat_template(cfg: Config, why: str) -> None:
    """The tokenizer has a chat template when ``why`` needs one (``builtin:`` models have one)."""
    key = "model.tokenizer_path" if cfg.model.tokenizer_path is not None else "model.path"
    path = cfg.model.tokenizer_path or cfg.model.path
    if path.startswith("builtin:"):
        return
    from transformers import AutoTokenizer

    if not getattr(AutoTokenizer.from_pretrained(path), "chat_template", None):
        raise ConfigError(f"{why} but the tokenizer of {key} {path!r} has no chat template; use a tokenizer "
                          f"with one (tokenizer_config.json chat_template) or set data.apply_chat_template "
                          f"false and multi-turn off")
