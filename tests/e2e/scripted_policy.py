"""A deterministic policy behind the rollout-engine interface, for testing multi-turn mechanics.

It reads the conversation it is asked to continue and writes canonical tokens (the
tokenizer's encoding of its text, then EOS), with probability 1 (log-prob 0). On
the first turn, sample j of a prompt "What is A op B? ..." writes, by j % 4:

    0: a correct calculator call, then "Answer: <the tool's output>"
    1: "Answer: 0" at once (no call)
    2: a call with an invalid expression, then "Answer: 0" after the error
    3: a call that is not JSON, then "Answer: 0" after the error

``python tests/e2e/scripted_train.py ...`` registers it as ``rollout.engine: scripted``.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import torch

from spmdrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, left_pad

_QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def call_text(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


class ScriptedRollout(RolloutEngine):
    runs_split = True  # it ignores the weights, wherever they come from

    def __init__(self, tokenizer, eos_token_id: int, pad_token_id: int) -> None:
        self.tokenizer, self.eos, self.pad = tokenizer, eos_token_id, pad_token_id
        self.calls = 0  # generate calls (turns) seen

    @classmethod
    def from_config(cls, cfg, model_path, *, mesh, device, eos_token_ids, pad_token_id):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return cls(tok, tok.eos_token_id, pad_token_id)

    def reply(self, conversation: str, j: int) -> str:
        user = conversation.rsplit("<|im_start|>user\n", 1)[-1]
        tools = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", user, re.S)
        if tools:
            return f"Answer: {tools[-1]}" if not tools[-1].startswith("Error") else "Answer: 0"
        m = _QUESTION.search(user)
        expression = f"{m.group(1)} {m.group(2)} {m.group(3)}" if m else "1 + 1"
        return [call_text(expression), "Answer: 0", call_text(expression + " +"),
                "<tool_call>{not json}</tool_call>"][j % 4]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        self.calls += 1
        n, R = sampling.n, sampling.max_tokens
        rows, finish = [], []
        for p in prompts:
            text = self.tokenizer.decode(list(p), skip_special_tokens=False)
            for j in range(n):
                ids = self.tokenizer.encode(self.reply(text, j), add_special_tokens=False) + [self.eos]
                finish.append("stop" if len(ids) <= R else "length")
                rows.append(ids[:R])
        N = len(rows)
        ids = torch.full((N, R), self.pad, dtype=torch.long)
        mask = torch.zeros(N, R, dtype=torch.bool)
        for k, r in enumerate(rows):
            ids[k, :len(r)] = torch.tensor(r)
            mask[k, :len(r)] = True
        prompt_ids, prompt_mask = left_pad(prompts, self.pad, torch.device("cpu"))
        idx = torch.arange(len(prompts)).repeat_interleave(n)
        logprobs = torch.zeros(N, R) if sampling.logprobs else None  # as the library engines skip them
        return GenerationOutput(prompt_ids[idx], prompt_mask[idx], ids, mask, logprobs, finish, idx)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:
            pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        pass
