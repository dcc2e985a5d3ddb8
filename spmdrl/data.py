"""Prompt data: verl-layout parquet in, this rank's share of each step's prompts out.

    files = data_files(cfg.data.train_files)  # builtin: already resolved (spmdrl.builtin.resolve_builtins)
    ds = PromptDataset(files, tokenizer, max_prompt_length=64, truncation="filter")
    loader = PromptLoader(ds, batch_size=16, rank=rank, world_size=world, seed=cfg.trainer.seed)
    prompts = next(loader)        # list[PromptItem]: this rank's contiguous block of the global batch

Rows follow verl's layout: ``prompt`` (a list of chat messages, or a plain
string), ``data_source``, ``reward_model.ground_truth`` and ``extra_info``.
Message lists go through the tokenizer's chat template with
``add_generation_prompt=True``; plain strings are tokenised as they are.

Every rank reads and tokenises the whole dataset (prompts are small next to a
rollout) so that filtering and shuffling need no communication: the global
order of epoch e is a shuffle seeded by (seed, e), and rank r of W takes the
r-th contiguous block of each mini-batch slot of each global batch
(spmdrl/placement.py). One rank and four ranks therefore train on the same
global batches and the same global mini-batches, and the n responses of a
prompt stay on the rank that owns the prompt.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from spmdrl.errors import ConfigError
from spmdrl.placement import slot_positions, slot_prompts

if TYPE_CHECKING:
    from spmdrl.config import Config, DataConfig

log = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")
ROLES = ("system", "user", "assistant", "tool")  # chat roles a prompt's messages may have


@dataclass
class PromptItem:
    """One prompt as the loop sees it."""

    index: int  # global prompt id (position in the dataset after filtering); unique within a run
    prompt_ids: list[int]  # tokens after the chat template and truncation
    raw_prompt: str  # the text that was tokenised (chat template applied)
    data_source: Optional[str]
    ground_truth: Any  # reward_model.ground_truth, passed to the scorer untouched
    extra_info: dict = field(default_factory=dict)
    chat: list = field(default_factory=list)  # the prompt as chat messages (a plain string: one user turn)
    order: int = -1  # position in the run's training stream (the loader's; spmdrl/placement.py), else -1


def data_files(files: Union[str, Sequence[str], None]) -> list[str]:
    """A list of parquet paths from a config value (``builtin:`` ones resolved already:
    ``spmdrl.builtin.resolve_builtins``)."""
    if files is None:
        return []
    return [files] if isinstance(files, str) else list(files)


def read_rows(path: str, prompt_key: str) -> dict[str, list]:
    """Columns prompt, data_source, reward_model and extra_info of a verl-layout parquet file, each row
    checked (``_check_row``); ValueError naming the file, row and column of the first bad one."""
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        names = pq.read_schema(path).names
    except Exception as e:
        raise ValueError(f"cannot read {path!r} as parquet: {e}") from e
    if prompt_key not in names:
        raise ValueError(
            f"data file {path!r} has no prompt column {prompt_key!r} (data.prompt_key); columns: "
            f"{', '.join(names)}"
        )
    wanted = [c for c in (prompt_key, "data_source", "reward_model", "extra_info") if c in names]
    try:
        table = pq.read_table(path, columns=wanted)
    except Exception as e:
        raise ValueError(f"cannot read {path!r} as parquet: {e}") from e
    n = table.num_rows
    cols = {c: _pylist(table.column(c)) for c in wanted}
    rows = {
        "prompt": cols[prompt_key],
        "data_source": cols.get("data_source", [None] * n),
        "reward_model": cols.get("reward_model", [None] * n),
        "extra_info": cols.get("extra_info", [None] * n),
    }
    for i in range(n):
        _check_row(path, i, prompt_key, *(rows[k][i] for k in ("prompt", "data_source", "reward_model",
                                                               "extra_info")))
    return rows


def _pylist(column: Any) -> list:
    """Python values of a parquet column; a map column (pandas writes dicts of one value type so) becomes
    dicts, as a struct column does."""
    import pyarrow as pa

    values = column.to_pylist()
    if pa.types.is_map(column.type):
        values = [None if v is None else dict(v) for v in values]
    return values


def _check_row(path: str, row: int, prompt_key: str, prompt: Any, data_source: Any, reward_model: Any,
               extra_info: Any) -> None:
    """One row in verl's layout, or a ValueError naming the file, the row, the column and what it must be."""
    at = f"row {row} of {path!r}"
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"column {prompt_key!r} of {at} is an empty prompt")
        if prompt.lstrip().startswith("[{") and _is_json_messages(prompt):
            raise ValueError(f"column {prompt_key!r} of {at} is JSON text of chat messages; store it as a "
                             f"list of {{'role', 'content'}} structs, as verl's datasets do")
    elif isinstance(prompt, list):
        if not prompt:
            raise ValueError(f"column {prompt_key!r} of {at} is an empty list of chat messages")
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
                got = {k: v for k, v in m.items() if k in ("role", "content")} if isinstance(m, dict) else m
                raise ValueError(f"message {j} in column {prompt_key!r} of {at} is {str(got)[:120]}; a chat "
                                 f"message needs a string content and a role among {', '.join(ROLES)}")
    else:
        raise ValueError(f"column {prompt_key!r} of {at} is neither a string nor a list of chat messages "
                         f"({{'role', 'content'}} dicts): {_kind(prompt)}")
    if data_source is not None and not isinstance(data_source, str):
        raise ValueError(f"column 'data_source' of {at} is {_kind(data_source)}; it must be a string")
    for key, value, holds in (("reward_model", reward_model, "ground_truth"),
                              ("extra_info", extra_info, "per-row values")):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"column {key!r} of {at} is {_kind(value)}; verl's layout has a struct there "
                             f"(a dict with {holds}, not JSON text)")


def _kind(value: Any) -> str:
    return f"the {type(value).__name__} {str(value)[:80]!r}"


def _is_json_messages(text: str) -> bool:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)


class PromptDataset:
    """All prompts of one or more parquet files, tokenised and length-checked up front.

    ``truncation`` decides what happens to a prompt over ``max_prompt_length``
    tokens: ``error`` raises naming the file and row, ``left`` keeps the last
    tokens (the end of the prompt, where the generation prompt sits), ``right``
    keeps the first tokens, ``filter`` drops the row and counts it in
    ``num_filtered``.
    """

    def __init__(
        self,
        files: Union[str, Path, Sequence[Union[str, Path]]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        truncation: str = "error",
        apply_chat_template: bool = True,
        tools: Optional[list[dict]] = None,
    ) -> None:
        """``tools``: OpenAI function schemas the chat template shows the model (multi-turn rollouts)."""
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be at least 1, got {max_prompt_length}")
        files = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
        if not files:
            raise ValueError("no data files given")
        self.files = files
        self.items: list[PromptItem] = []
        self.num_filtered = 0
        for path in files:
            self._load(path, tokenizer, prompt_key, max_prompt_length, truncation, apply_chat_template, tools)
        if not self.items:
            raise ValueError(
                f"no prompts left in {', '.join(files)} after filtering {self.num_filtered} rows over "
                f"data.max_prompt_length={max_prompt_length}"
            )
        if self.num_filtered:
            log.warning("dropped %d prompts over data.max_prompt_length=%d from %s", self.num_filtered,
                        max_prompt_length, ", ".join(files))

    def _load(self, path: str, tokenizer: Any, prompt_key: str, max_len: int, truncation: str, chat: bool,
              tools: Optional[list[dict]] = None) -> None:
        rows = read_rows(path, prompt_key)
        texts, templated = [], []
        for i, prompt in enumerate(rows["prompt"]):
            text, used_template = self._render(prompt, tokenizer, chat, path, i, prompt_key, tools)
            texts.append(text)
            templated.append(used_template)
        # Templated text already carries the model's special tokens (BOS, role
        # markers); plain text gets them from the tokenizer as in pretraining.
        ids: list[Optional[list[int]]] = [None] * len(texts)
        for flag in (True, False):
            rows_with = [i for i, t in enumerate(templated) if t is flag]
            if rows_with:
                enc = tokenizer([texts[i] for i in rows_with], add_special_tokens=not flag)["input_ids"]
                for i, e in zip(rows_with, enc):
                    ids[i] = list(e)
        for i, tokens in enumerate(ids):
            assert tokens is not None
            if not tokens:
                raise ValueError(f"prompt of row {i} in {path!r} is empty after tokenisation")
            if len(tokens) > max_len:
                if truncation == "error":
                    raise ValueError(
                        f"prompt of row {i} in {path!r} has {len(tokens)} tokens, over "
                        f"data.max_prompt_length={max_len}; raise it or set data.truncation to left, right "
                        f"or filter"
                    )
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                tokens = tokens[-max_len:] if truncation == "left" else tokens[:max_len]
            reward_model = rows["reward_model"][i] or {}
            self.items.append(
                PromptItem(
                    index=len(self.items),
                    prompt_ids=tokens,
                    raw_prompt=texts[i],
                    data_source=rows["data_source"][i],
                    ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                    extra_info=dict(rows["extra_info"][i] or {}),
                    chat=_messages(rows["prompt"][i]),
                )
            )

    @staticmethod
    def _render(prompt: Any, tokenizer: Any, chat: bool, path: str, row: int, key: str,
                tools: Optional[list[dict]] = None) -> tuple[str, bool]:
        if isinstance(prompt, str):
            return prompt, False
        if not (isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)):
            raise ValueError(
                f"column {key!r} of row {row} in {path!r} is neither a string nor a list of chat messages "
                f"({{'role', 'content'}} dicts): {str(prompt)[:200]}"
            )
        if not chat:
            return "\n".join(str(m["content"]) for m in prompt), False
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"row {row} in {path!r} holds chat messages but the tokenizer has no chat template; "
                "set data.apply_chat_template=false or use a tokenizer with one"
            )
        # Parquet struct columns come back with every key of every message;
        # drop the null ones so templates that test `'key' in message` behave.
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        # With tools, templates that know them (Qwen2.5's Hermes template) list them in the system prompt.
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return text, True

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def _messages(prompt: Any) -> list[dict]:
    """The prompt as chat messages, for a reward model that renders it with its own template."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def _share(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous block of ``n`` items (sizes differ by at most one)."""
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")


class PromptLoader:
    """Endless (or ``num_epochs``-long) stream of this rank's share of each training batch.

    Each step takes the next ``batch_size`` prompts of the epoch's global order
    (an incomplete last batch is dropped) and returns rank ``rank``'s
    ``batch_size / world_size`` of them: its contiguous block of each ``slot``
    (prompts inside one mini-batch of every trained model, spmdrl/placement.py;
    by default the whole batch), so that every global mini-batch holds the same
    prompts at any world size. Each item's ``order`` is its position in the
    run's stream. ``state_dict`` records (epoch, position); a loader restored
    from it continues with the same prompts the original would have produced.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: Optional[int] = None,
        slot: Optional[int] = None,
        batch_key: str = "data.train_batch_size",
    ) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(f"{batch_key}={batch_size} must be a positive multiple of the world size "
                             f"{world_size}")
        if len(dataset) < batch_size:
            raise ValueError(f"{batch_key}={batch_size} is larger than the training set "
                             f"({len(dataset)} prompts)")
        self.batch_key = batch_key
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_epochs = num_epochs
        self.slot = slot or batch_size
        self.epoch = 0
        self.position = 0  # next batch within the epoch
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                # A string seed is hashed deterministically (sha512), independent of the world size.
                random.Random(f"spmdrl-data/{self.seed}/{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def global_indices(self, epoch: int, step: int) -> list[int]:
        """Dataset positions of the whole world's batch ``step`` of ``epoch``."""
        start = step * self.batch_size
        return self._epoch_order(epoch)[start : start + self.batch_size]

    @property
    def exhausted(self) -> bool:
        """Whether ``num_epochs`` are used up (the next ``next`` would stop)."""
        epoch = self.epoch + (self.position >= self.steps_per_epoch)
        return self.num_epochs is not None and epoch >= self.num_epochs

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> list[PromptItem]:
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        batch = self.global_indices(self.epoch, self.position)
        first = (self.epoch * self.steps_per_epoch + self.position) * self.batch_size
        self.position += 1
        return [replace(self.dataset[batch[p]], order=first + p)
                for p in slot_positions(len(batch), self.slot, self.rank, self.world_size)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_prompts": len(self.dataset), "batch_size": self.batch_size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # A different dataset, batch size, seed or shuffle would silently change the order (prompts of the
        # epoch repeated or skipped); refuse instead.
        for key, mine, config_key in (("num_prompts", len(self.dataset), "the training files"),
                                      ("batch_size", self.batch_size, self.batch_key),
                                      ("seed", self.seed, "trainer.seed"),
                                      ("shuffle", int(self.shuffle), "data.shuffle")):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"data loader checkpoint has {key}={state[key]}, but this run has {mine} "
                                 f"({config_key}); resume with the value that saved it or start afresh")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class ValidationLoader:
    """Every prompt once, in file order, in global batches of ``batch_size``; each rank gets its block.

    Nothing is dropped, so the last batch may be short and a rank's share may
    be empty; every rank still sees the same number of batches, so collectives
    inside a validation step stay matched.
    """

    def __init__(self, dataset: PromptDataset, *, batch_size: int, rank: int, world_size: int) -> None:
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise ValueError(f"data.val_batch_size must be at least 1, got {batch_size}")
        self.dataset, self.batch_size, self.rank, self.world_size = dataset, batch_size, rank, world_size

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> Iterator[list[PromptItem]]:
        n = len(self.dataset)
        for start in range(0, n, self.batch_size):
            batch = list(range(start, min(start + self.batch_size, n)))
            yield [self.dataset[i] for i in batch[_share(len(batch), self.rank, self.world_size)]]


def _dataset(cfg: "DataConfig", files: list[str], tokenizer: Any,
             tools: Optional[list[dict]] = None) -> PromptDataset:
    return PromptDataset(
        files, tokenizer, prompt_key=cfg.prompt_key, max_prompt_length=cfg.max_prompt_length,
        truncation=cfg.truncation, apply_chat_template=cfg.apply_chat_template, tools=tools,
    )


def build_train_loader(
    cfg: "DataConfig", tokenizer: Any, *, rank: int, world_size: int, seed: int,
    num_epochs: Optional[int] = None, tools: Optional[list[dict]] = None, slot: Optional[int] = None,
) -> PromptLoader:
    """The training loader of ``cfg``; ``seed`` orders the prompts; ``tools`` (function schemas) go to the
    chat template; ``slot``: prompts per mini-batch slot (``placement.slot_prompts``)."""
    files = data_files(cfg.train_files)
    return PromptLoader(
        _dataset(cfg, files, tokenizer, tools), batch_size=cfg.draw_size, rank=rank,
        world_size=world_size, shuffle=cfg.shuffle, seed=seed, num_epochs=num_epochs, slot=slot,
        batch_key=cfg.draw_key,
    )


def build_val_loader(
    cfg: "DataConfig", tokenizer: Any, *, rank: int, world_size: int, tools: Optional[list[dict]] = None,
) -> Optional[ValidationLoader]:
    """The validation loader of ``cfg``, or None when ``data.val_files`` is null/empty."""
    files = data_files(cfg.val_files)
    if not files:
        return None
    return ValidationLoader(_dataset(cfg, files, tokenizer, tools), batch_size=cfg.val_batch_size, rank=rank,
                            world_size=world_size)


def build_loaders(cfg: "Config", tokenizer: Any, *, rank: int, world_size: int
                  ) -> tuple[PromptLoader, Optional[ValidationLoader]]:
    """The run's training and validation loaders for rollout-DP rank ``rank`` of ``world_size`` (whole prompts
    per rank), with the tools' schemas in the chat template when multi-turn is on. A bad file or column is
    a ConfigError."""
    from spmdrl.agent.tools import load_tool_config

    mt = cfg.rollout.multi_turn
    tools = [s.tool_schema for s in load_tool_config(mt.tool_config_path)] if mt.enable else None
    try:
        # Without trainer.total_steps the run is total_epochs passes, however many batches a step draws
        # (DAPO's extra rounds): the loader stops there, as verl's epoch loop does.
        epochs = cfg.trainer.total_epochs if cfg.trainer.total_steps is None else None
        train = build_train_loader(cfg.data, tokenizer, rank=rank, world_size=world_size,
                                   seed=cfg.trainer.seed, num_epochs=epochs, tools=tools,
                                   slot=slot_prompts(cfg))
        val = build_val_loader(cfg.data, tokenizer, rank=rank, world_size=world_size, tools=tools)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from err
    return train, val
