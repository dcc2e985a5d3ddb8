"""Model-based reward (``reward_model.enable``): a sequence-classification model scores prompt + response.

    rm = RewardModelScorer.from_config(cfg, dims, device)       # collective: every rank builds its shard
    scores = rm.model_scores(chats, responses)                  # [N] for this rank's rows

The reward model is a Hugging Face ``*ForSequenceClassification`` folder with
one label (``reward_model.model.path``; the tiny-model kit builds one as
``builtin:tiny-rm``). It runs as a frozen ``reward`` engine of the training
backend (FSDP2: sharded over the same mesh as the actor, no-grad forward in
micro-batches of ``reward_model.micro_batch_size_per_gpu``), so each rank
scores its own rows and the parameters are all-gathered layer by layer, as
the reference policy's are.

Each response is decoded with the policy's tokenizer, appended to its prompt's
chat messages as the assistant turn and rendered with the reward model's own
chat template (verl's ``_switch_chat_template``), then tokenised with the
reward model's tokenizer, cut on the right at ``reward_model.max_length`` and
right-padded; the score is the head's output at the last token.

It is one of the run's weighted reward sources (``spmdrl.reward.sources``):
``score = reward_model.rm_weight * rm + reward_model.rule_weight * rule``. The
defaults (1, 0) are verl's behaviour: with a reward model, its score replaces the
rule score and the rule function is not called. With ``rule_weight`` != 0 both
run (e.g. a correctness check plus a learned preference).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from spmdrl.batch import Batch

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.engines.base import TrainEngine
    from spmdrl.parallel import ParallelDims


def render(tokenizer: Any, chats: Sequence[Sequence[dict]], responses: Sequence[str],
           turns: Optional[Sequence[Optional[Sequence[dict]]]] = None) -> list[str]:
    """Each prompt's chat messages with the response as the assistant's turn, in ``tokenizer``'s chat
    template; where ``turns`` gives a row's conversation after the prompt (a multi-turn response: assistant
    and tool messages), those messages instead."""
    turns = turns if turns is not None else [None] * len(responses)
    return [
        tokenizer.apply_chat_template([*chat, *(rest or [{"role": "assistant", "content": response}])],
                                      tokenize=False, add_generation_prompt=False)
        for chat, response, rest in zip(chats, responses, turns)
    ]


def encode(tokenizer: Any, texts: Sequence[str], max_length: Optional[int], pad_token_id: int) -> Batch:
    """Right-padded rows of rendered texts (templated, so no special tokens are added), cut on the right at
    ``max_length``: ``input_ids``, ``attention_mask``, ``position_ids`` [N, L]."""
    ids = [list(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    if max_length is not None:
        ids = [x[:max_length] for x in ids]
    ids = [x or [pad_token_id] for x in ids]  # an empty rendering still needs one token to score
    width = max((len(x) for x in ids), default=1)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)  # [N, L]
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # [N, L]
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        attention_mask[i, : len(x)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [N, L]
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})


class RewardModelScorer:
    """This rank's reward-model engine and tokenizer, and how prompt + response are rendered for it."""

    def __init__(self, engine: "TrainEngine", tokenizer: Any, *, group: dist.ProcessGroup,
                 micro_batch_size: int, max_length: Optional[int],
                 max_token_len: Optional[int] = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("reward_model.model.path has a tokenizer without a chat template; the reward "
                             "model scores prompt + response rendered with its own chat template")
        self.engine, self.tokenizer, self.group = engine, tokenizer, group
        self.micro_batch_size, self.max_length = micro_batch_size, max_length
        self.max_token_len = max_token_len  # micro-batches cut by tokens (use_dynamic_bsz), or None
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad if pad is not None else 0)

    @classmethod
    def from_config(cls, cfg: "Config", dims: "ParallelDims", device: torch.device) -> "RewardModelScorer":
        """Build the reward engine on every rank (collective), from ``reward_model.*`` (``builtin:`` paths
        already resolved)."""
        from transformers import AutoTokenizer

        from spmdrl.engines import build_engine

        rm = cfg.reward_model
        assert rm.model.path is not None  # the config checks refuse reward_model.enable without a path
        engine = build_engine(cfg, rm.model.path, role="reward", dims=dims, device=device)
        return cls(engine, AutoTokenizer.from_pretrained(rm.model.path), group=dims.batch_group,
                   micro_batch_size=rm.micro_batch_size_per_gpu, max_length=rm.max_length,
                   max_token_len=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None)

    def model_scores(self, chats: Sequence[Sequence[dict]], responses: Sequence[str],
                     turns: Optional[Sequence[Optional[Sequence[dict]]]] = None) -> torch.Tensor:
        """The reward model's score of each (prompt chat, response) of this rank: [N] float32; ``turns``:
        each row's conversation after the prompt, for multi-turn responses (``render``).

        Collective: every rank calls it for every batch, holding any number of rows (0 too). The engine runs
        the same number of forwards on every rank, so rows are padded to the largest rank's count with a
        one-token filler that is dropped afterwards.
        """
        n = len(responses)
        # NCCL reduces only device tensors; gloo only host ones.
        on = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl"
              else "cpu")
        most = torch.tensor([n], dtype=torch.int64, device=on)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        if int(most) == 0:
            return torch.zeros(0)
        texts = render(self.tokenizer, chats, responses, turns)
        texts += [""] * (int(most) - n)  # fillers: one pad token each (encode)
        batch = encode(self.tokenizer, texts, self.max_length, self.pad_token_id)
        scores = self.engine.forward_no_grad(batch, self.micro_batch_size, max_token_len=self.max_token_len)
        return scores["rm_scores"][:n].float().cpu()  # [N]


def check_weights(rm_weight: float, rule_weight: float) -> None:
    """Raise ValueError (one sentence) on weights that make no reward."""
    for key, value in (("reward_model.rm_weight", rm_weight), ("reward_model.rule_weight", rule_weight)):
        if not math.isfinite(value):
            raise ValueError(f"{key} is {value}; it must be a finite number")
    if rm_weight == 0 and rule_weight == 0:
        raise ValueError("reward_model.rm_weight and reward_model.rule_weight are both 0; the reward would "
                         "be 0")
