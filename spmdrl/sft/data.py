"""SFT data: verl's SFT parquet layouts in, tokenised rows with a loss mask out, and their batches.

    ds = SFTDataset(files, tokenizer, cfg.data)      # every row rendered, masked and checked up front
    loader = PromptLoader(ds, batch_size=..., rank=r, world_size=w, seed=s)   # spmdrl.data's loader
    batch = collate(next(loader), pad_id)            # Batch: input_ids, attention_mask, position_ids,
                                                     #        response_mask
Two layouts, as verl's SFT trainer reads them:

- prompt/response columns (``data.prompt_key``, ``data.response_key``; ``*_dict_keys`` walk into nested
  dicts). A string prompt is one user turn and a list is chat messages; either is rendered with the
  tokenizer's chat template and its generation prompt (the tokens the RL loader gives the same prompt),
  then the response text plus EOS. The loss covers the response tokens.
- chat messages (``data.multiturn.enable``, ``data.multiturn.messages_key``): the whole conversation through
  the chat template. The loss covers each assistant turn's content and end-of-turn token; system, user and
  tool turns and the template's role headers are context. The spans come from rendering prefixes of the
  conversation: assistant turn i is the text between the render of messages[:i] with the generation prompt
  and the render of messages[:i+1], and a token is trained when its first character lies in such a span
  (the tokenizer's offsets).

Rows are cut to ``data.max_length`` tokens as ``data.truncation`` says (error, left, right). Every mistake in
a file (a missing column or dict key, a message without a role, a chat without an assistant turn, a row left
without response tokens) is a ConfigError naming the file, the row and the key, raised while the dataset is
built: before any model is loaded.

A batch lays each row out as a one-token "prompt" (its first token) and a "response" of the rest, so the
engines' per-response-token log-probs are the log-probs of every token after the first and
``response_mask`` [N, L-1] is the loss mask shifted by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from spmdrl.batch import Batch
from spmdrl.errors import ConfigError

if TYPE_CHECKING:
    from spmdrl.sft.config import SFTDataConfig


@dataclass
class SFTItem:
    index: int  # position in the dataset
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens that are trained as targets (never the first token)
    order: int = -1  # position in the run's stream (set by the loader, spmdrl.data.PromptLoader)


def _read_table(path: str, columns: list[str]) -> dict[str, list]:
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise ConfigError(f"data file {path!r} does not exist")
    try:
        names = pq.read_schema(path).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"data file {path!r} has no column {missing[0]!r} (row 0); columns: "
                              f"{', '.join(names)}")
        table = pq.read_table(path, columns=columns)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"cannot read {path!r} as parquet: {' '.join(str(err).split())}") from err
    return {c: table.column(c).to_pylist() for c in columns}


def _dig(value: Any, keys: Sequence[str], where: str) -> Any:
    """``value[k1][k2]...``: the nested field ``*_dict_keys`` name (parquet gives a struct's absent field as
    None)."""
    for key in keys:
        if not isinstance(value, dict) or value.get(key) is None:
            raise ConfigError(f"{where} has no dict key {key!r} (data.*_dict_keys); it holds "
                              f"{str(value)[:120]}")
        value = value[key]
    return value


def _messages(value: Any, where: str) -> list[dict]:
    """Chat messages of one row, with parquet's null struct fields dropped."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} is not a non-empty list of chat messages: {str(value)[:120]}")
    out = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not msg.get("role"):
            raise ConfigError(f"{where}: message {j} has no role (each message needs role and content)")
        if msg.get("content") is None and not msg.get("tool_calls"):
            raise ConfigError(f"{where}: message {j} ({msg['role']}) has no content")
        out.append({k: v for k, v in msg.items() if v is not None})
    return out


class SFTDataset:
    """Every row of the files, rendered, tokenised, masked and checked once (rows are small)."""

    def __init__(self, files: Sequence[str], tokenizer: Any, cfg: "SFTDataConfig") -> None:
        if not files:
            raise ConfigError("no SFT data files given (data.train_files)")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; spmdrl.sft renders every row with it")
        self.tokenizer, self.cfg = tokenizer, cfg
        self.items: list[SFTItem] = []
        for path in files:
            if cfg.multiturn.enable:
                rows = _read_table(path, [cfg.multiturn.messages_key])[cfg.multiturn.messages_key]
                for i, value in enumerate(rows):
                    where = f"row {i} of {path!r}, column {cfg.multiturn.messages_key!r}"
                    self._add(*self._chat(_messages(value, where), where), where)
            else:
                cols = _read_table(path, list(dict.fromkeys([cfg.prompt_key, cfg.response_key])))
                for i, (prompt, response) in enumerate(zip(cols[cfg.prompt_key], cols[cfg.response_key])):
                    where = f"row {i} of {path!r}"
                    self._add(*self._pair(prompt, response, where), where)

    def _pair(self, prompt: Any, response: Any, where: str) -> tuple[list[int], list[int]]:
        cfg, tok = self.cfg, self.tokenizer
        prompt = _dig(prompt, cfg.prompt_dict_keys or [], f"{where}, column {cfg.prompt_key!r}")
        response = _dig(response, cfg.response_dict_keys or [], f"{where}, column {cfg.response_key!r}")
        if not isinstance(response, str):
            raise ConfigError(f"{where}, column {cfg.response_key!r}: the response is not a string: "
                              f"{str(response)[:120]}")
        chat = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else _messages(prompt, f"{where}, column {cfg.prompt_key!r}"))
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        response_ids = tok(response + tok.eos_token, add_special_tokens=False)["input_ids"]
        return list(prompt_ids) + list(response_ids), [0] * len(prompt_ids) + [1] * len(response_ids)

    def _chat(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if not any(msg["role"] == "assistant" for msg in messages):
            raise ConfigError(f"{where}: the chat has no assistant turn, so nothing would be trained")
        try:
            text = tok.apply_chat_template(messages, tokenize=False)
        except Exception as err:  # the template's own error (jinja): a fact about this row
            raise ConfigError(f"{where}: the tokenizer's chat template cannot render it "
                              f"({type(err).__name__}: {' '.join(str(err).split())})") from err
        spans = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = (tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                      if i else "")
            upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ConfigError(f"{where}: the chat template does not render the conversation's prefixes "
                                  f"as prefixes of the whole (message {i}), so its assistant tokens cannot "
                                  f"be found")
            # The turn's content and end-of-turn token; whitespace the template puts after it is context.
            spans.append((len(before), len(upto.rstrip())))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _add(self, ids: list[int], mask: list[int], where: str) -> None:
        cfg, n = self.cfg, len(ids)
        if n > cfg.max_length:
            if cfg.truncation == "error":
                raise ConfigError(f"{where} has {n} tokens, over data.max_length={cfg.max_length}; raise it "
                                  f"or set data.truncation to left or right")
            keep = slice(n - cfg.max_length, n) if cfg.truncation == "left" else slice(0, cfg.max_length)
            ids, mask = ids[keep], mask[keep]
        if not any(mask[1:]):
            raise ConfigError(f"{where} has no response tokens left to train on after truncation to "
                              f"data.max_length={cfg.max_length} (data.truncation={cfg.truncation}); the "
                              f"response key {self._response_key()!r} is empty or cut off")
        self.items.append(SFTItem(len(self.items), ids, [0] + mask[1:]))

    def _response_key(self) -> str:
        return self.cfg.multiturn.messages_key if self.cfg.multiturn.enable else self.cfg.response_key

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> SFTItem:
        return self.items[i]


def collate(items: Sequence[SFTItem], pad_id: int) -> Batch:
    """Rows right-padded to the longest: input_ids / attention_mask / position_ids [n, L], response_mask
    [n, L-1] (1 where token t+1 is a target)."""
    width = max(len(it.input_ids) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    target = torch.zeros((len(items), width), dtype=torch.float32)
    for row, it in enumerate(items):
        n = len(it.input_ids)
        ids[row, :n] = torch.tensor(it.input_ids)
        attn[row, :n] = 1
        target[row, :n] = torch.tensor(it.loss_mask, dtype=torch.float32)
    positions = (attn.cumsum(1) - 1).clamp(min=0)  # [n, L]
    return Batch({"input_ids": ids, "attention_mask": attn, "position_ids": positions,
                  "response_mask": target[:, 1:]})  # [n, L-1]


def val_batches(ds: SFTDataset, per_rank: int, rank: int, world_size: int) -> Iterator[list[SFTItem]]:
    """Every row once, in global batches of ``per_rank x world_size``; each rank gets ``per_rank`` rows, the
    last batch's missing ones as masked copies of row 0, so every rank runs the same forwards (FSDP's
    all-gathers) and the padding adds nothing to the loss."""
    size = per_rank * world_size
    for start in range(0, len(ds), size):
        mine = list(range(start + rank * per_rank, start + (rank + 1) * per_rank))
        pad = SFTItem(-1, ds[0].input_ids, [0] * len(ds[0].input_ids))
        yield [ds[i] if i < len(ds) else pad for i in mine]
