"""Tool-call syntax (Hermes) and the tokens the chat template puts around tool responses.

A Hermes model ends an assistant turn that calls tools like this (Qwen2.5, Qwen3, NousHermes)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call><|im_end|>

The loop then appends the tool messages exactly as the tokenizer's chat template
renders them in context, followed by the template's next assistant header, and
the model continues. ``ChatTokens.tool_turn`` finds those tokens by rendering a
conversation with and without the tool messages and keeping what comes after
the assistant's end-of-turn token, so the trainer's sequence is, token for
token, the template's tokenization of the whole conversation (where the model's
own tokens are the tokenizer's tokenization of its text; sampled tokens are
kept as sampled).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    """One tool call the model wrote; ``error`` set when the block was not a valid call."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""


def _blocks(text: str) -> list[str]:
    """The text of every ``<tool_call>...</tool_call>`` block, in order, in one pass (a regex with a lazy
    group rescans to the end from every unclosed opening: quadratic in a response full of them)."""
    blocks, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        blocks.append(text[start + len(_OPEN):end])
        pos = end + len(_CLOSE)
    return blocks


def _json(text: str) -> tuple[Any, str]:
    """(value, "") or (None, why ``text`` is not usable JSON); never raises."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg})"
    except RecursionError:  # "[[[[..." nested past the interpreter's limit: the model's text, not our bug
        return None, "nested too deeply to parse"
    except ValueError as err:  # e.g. an integer past sys.get_int_max_str_digits()
        return None, f"not usable JSON ({str(err)[:80]})"


def parse_hermes(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order; malformed blocks carry
    ``error``. Linear in ``len(text)`` and never raises, whatever the model wrote."""
    calls = []
    for block in _blocks(text):
        obj, why = _json(block)
        if why:
            calls.append(ParsedCall(error=f"the tool call is {why}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParsedCall(error='a tool call must be a JSON object with a "name" string'))
            continue
        args: Any = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API does
            decoded, why = _json(args)
            args = args if why else decoded
        if not isinstance(args, dict):
            calls.append(ParsedCall(obj["name"], error='"arguments" must be a JSON object'))
            continue
        calls.append(ParsedCall(obj["name"], args))
    return calls


PARSERS = {"hermes": parse_hermes}


def truncate(ids: list[int], max_len: int, side: str) -> tuple[list[int], bool]:
    """At most ``max_len`` of ``ids``; as verl's ``tool_response_truncate_side``: ``left`` keeps the
    beginning, ``right`` keeps the end, ``middle`` keeps both ends."""
    if len(ids) <= max_len:
        return ids, False
    if side == "left":
        return ids[:max_len], True
    if side == "right":
        return ids[len(ids) - max_len:], True
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head):], True


class ChatTokens:
    """Tokens the chat template adds between an assistant turn and the next one."""

    # A neutral conversation to render tool messages after; only what follows its assistant turn is used.
    _BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]

    def __init__(self, tokenizer: Any, end_of_turn_ids: Sequence[int], *, max_tool_response_length: int,
                 truncate_side: str) -> None:
        self.tokenizer = tokenizer
        self.end_ids = set(end_of_turn_ids)
        self.max_len, self.side = max_tool_response_length, truncate_side
        self._before = self.render(self._BASE, add_generation_prompt=False)
        specials = set(getattr(tokenizer, "all_special_tokens", [])) | set(tokenizer.get_added_vocab())
        # Longest first, so a token that contains another is matched whole.
        pattern = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True) if len(t) > 1)
        self._specials = re.compile(pattern) if pattern else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
        """The template's tokenization of ``messages``."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def clip(self, content: str) -> tuple[str, bool]:
        """``content`` cut to ``max_tool_response_length`` tokens (decoded back to text for the template)."""
        ids, cut = truncate(self.encode(content), self.max_len, self.side)
        return (self.tokenizer.decode(ids) if cut else content), cut

    def plain(self, text: str) -> str:
        """``text`` with every special or added token's text broken by a zero-width space after its first
        character, so it tokenizes as plain text: a tool that prints ``<|im_end|>`` cannot end its turn or
        open another."""
        if self._specials is None:
            return text
        for _ in range(8):  # a break cannot create a new match unless a token contains U+200B itself
            new = self._specials.sub(lambda m: m[0][0] + "\u200b" + m[0][1:], text)
            if new == text:
                return text
            text = new
        return text

    def tool_content(self, text: str) -> str:
        """A tool's output as it goes into the conversation: special-token text neutralised, cut to
        ``max_tool_response_length`` tokens, and neutralised again (a middle cut can join two halves)."""
        return self.plain(self.clip(self.plain(text))[0])

    def tool_turn(self, contents: Sequence[str]) -> list[int]:
        """Tokens after the assistant's end-of-turn token: the tool messages ``contents`` and the next
        assistant header, as the template renders them after an assistant turn."""
        before = self._before
        after = self.render(self._BASE + [{"role": "tool", "content": c} for c in contents],
                            add_generation_prompt=True)
        ends = [i for i, t in enumerate(before) if t in self.end_ids]
        if not ends or after[: ends[-1] + 1] != before[: ends[-1] + 1]:
            raise ValueError("the chat template does not end an assistant turn with an end-of-turn (EOS) "
                             "token, or renders earlier messages differently when tool messages follow; "
                             "multi-turn rollouts need a template where appending messages only appends "
                             "tokens")
        return after[ends[-1] + 1:]
