"""Every reward source as one entry of a weighted list, combined in one place (as TRL's ``reward_funcs`` and
``reward_weights``).

    rewards = build_rewards(cfg, dims, device, tokenizer)  # collective: a reward model is built on every rank
    result = rewards(batch)                               # scores [N], metrics, per-response extras
    rewards.close()

A source scores this rank's rows of a batch (the decoded responses are shared)
and has a weight; the sequence score is ``sum(weight * source_score)`` in list
order. The sources:

- ``rule``: ``reward.function`` (a built-in scorer per ``data_source``, or the
  user's ``file.py:function``) through ``RewardManager``; its per-response
  extras (``acc``, ``pred``, ...) ride along. Weight 1, or
  ``reward_model.rule_weight`` next to a reward model; left out when that is 0
  (verl: the model's score replaces the rule score).
- ``rm``: the reward model (``reward_model.enable``), weight
  ``reward_model.rm_weight``. Collective: every rank scores every batch.
- ``tool``: the tools' ``calc_reward`` summed per trajectory (multi-turn).
- ``overlong``: DAPO's soft length penalty (``reward.overlong_buffer``).

A new source is one more entry in ``build_rewards``.

Under split placement (spmdrl/split/) the sources are divided by role: the
rollout ranks hold those that need no trained model (``RankRole.ROLLOUT``: their
sum is the batch's ``scores`` as sent, 0 where the reward model is the only
source) and the training ranks the reward model (``RankRole.TRAINING``), whose
weighted score they add to the rows they train on. Where the score is needed
as responses are generated (``scored_at_rollout``: DAPO's dynamic sampling
keeps groups by it, ReMax scores a greedy baseline) the rollout ranks ask the
training ranks' model for it instead (``AskedModelReward``), in the reward
model's place among the sources, so the batch leaves them scored whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from spmdrl.algos.dapo import overlong_penalty
from spmdrl.batch import Batch
from spmdrl.errors import ConfigError
from spmdrl.parallel import ParallelDims, RankRole
from spmdrl.reward.rule import RewardManager, decode_responses

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.reward.model import RewardModelScorer


@dataclass
class SourceScores:
    """What one source says about this rank's rows."""

    scores: torch.Tensor  # [N] float32
    metrics: dict[str, float] = field(default_factory=dict)  # local values; the loop reduces them over ranks
    # per-response values (acc, pred, ...) for validation
    extra: dict[str, list] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # one message per response the source failed to score


class RewardSource(Protocol):
    name: str
    weight: float
    collective: bool  # True: every rank must call it for every batch, even with no rows

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores: ...


@dataclass
class RewardResult:
    scores: torch.Tensor  # [N] float32, the weighted sum
    metrics: dict[str, float]
    extra: dict[str, list]
    errors: list[str] = field(default_factory=list)  # the rule function's failures (reward.function)


def combine(terms: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``sum(weight * scores)`` over ``terms`` in order ([N] each, float32)."""
    total: Optional[torch.Tensor] = None
    for weight, scores in terms:
        term = weight * scores.float()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no reward source is enabled; the reward would be undefined")
    return total


class Rewards:
    """The run's reward sources and their combination."""

    def __init__(self, sources: Sequence[RewardSource], tokenizer: Any, partial: bool = False) -> None:
        """``partial``: the other sources score elsewhere (split placement's rollout ranks, next to a reward
        model on the training ranks), so none here is allowed (every score 0)."""
        if not sources and not partial:
            raise ValueError("no reward source is enabled; the reward would be undefined")
        self.sources = list(sources)
        self.tokenizer, self.partial = tokenizer, partial

    @property
    def collective(self) -> bool:
        """Whether some source needs every rank for every batch (so an empty share still calls it)."""
        return any(s.collective for s in self.sources)

    def __call__(self, batch: Batch) -> RewardResult:
        return self.score_texts(batch, response_texts(self.tokenizer, batch))

    def score_texts(self, batch: Batch, texts: Sequence[str]) -> RewardResult:
        """``__call__`` with the responses already decoded (``response_texts``): a split placement's
        validation rows reach the training ranks' reward model as texts."""
        terms, metrics, extra, errors = [], {}, {}, []
        for source in self.sources:
            out = source(batch, texts)
            terms.append((source.weight, out.scores))
            metrics.update(out.metrics)
            extra.update(out.extra)
            errors += out.errors
        for key, values in extra.items():  # e.g. a scorer's "acc", next to its "score"
            numbers = [float(v) for v in values if isinstance(v, (int, float, bool))]
            if numbers:
                metrics[f"reward/{key}"] = sum(numbers) / len(numbers)
        scores = combine(terms) if terms else torch.zeros(len(texts))  # [N] (partial, with no source here)
        return RewardResult(scores, metrics, extra, errors)

    def join_collectives(self) -> None:
        """Take part, with no rows, in the collectives of the sources that need every rank (a rank whose
        validation share is empty)."""
        empty = Batch({"response_mask": torch.zeros(0, 1)}, {"chat": []})
        for source in self.sources:
            if source.collective:
                source(empty, [])

    def connect(self, ask: Callable[[dict[str, list]], torch.Tensor]) -> None:
        """Give the sources that score elsewhere (``AskedModelReward``) the way to ask: split placement's
        exchange, made after the sources."""
        for source in self.sources:
            if isinstance(source, AskedModelReward):
                source.ask = ask

    def close(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()


def response_texts(tokenizer: Any, batch: Batch) -> list[str]:
    """Each row's response as text: the whole response, tool output included (as verl decodes it); the
    generated tokens single-turn."""
    R = batch["response_mask"].shape[1]
    return decode_responses(tokenizer, batch["input_ids"][:, -R:], batch["attention_mask"][:, -R:])


class RuleReward:
    """``reward.function`` on each response; ``report_mean`` adds ``reward/rule_score/mean`` (next to a reward
    model, where the two scores are mixed)."""

    name, collective = "rule", False

    def __init__(self, manager: RewardManager, weight: float = 1.0, report_mean: bool = False) -> None:
        self.manager, self.weight, self.report_mean = manager, weight, report_mean

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores:
        out = self.manager(batch["data_source"], texts, batch["ground_truth"], batch["extra_info"])
        metrics = out.metrics()
        if self.report_mean and len(out.scores):
            metrics["reward/rule_score/mean"] = float(out.scores.float().mean())
        return SourceScores(out.scores, metrics, out.extra, out.errors)

    def close(self) -> None:
        self.manager.close()


class ModelReward:
    """The reward model's score of prompt + response (collective: its forward runs on every rank)."""

    name, collective = "rm", True

    def __init__(self, scorer: "RewardModelScorer", weight: float) -> None:
        self.scorer, self.weight = scorer, weight

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores:
        # A multi-turn response is a conversation (assistant and tool turns, extra_info["messages"]): the
        # model scores it whole, not one decoded message.
        turns = [info.get("messages") if isinstance(info, dict) else None
                 for info in batch.get("extra_info", [None] * len(texts))]
        scores = self.scorer.model_scores(batch["chat"], texts, turns)  # [N]
        metrics = {"reward/rm_score/mean": float(scores.mean())} if len(scores) else {}
        return SourceScores(scores, metrics)


def reward_model_inputs(batch: Batch, texts: Sequence[str]) -> dict[str, list]:
    """What a reward model needs of each row, JSON-able: the prompt's chat, the response's text and the
    extra_info (a multi-turn response's conversation is there)."""
    return {"chat": list(batch["chat"]), "text": list(texts),
            "extra_info": list(batch.get("extra_info", [None] * len(texts)))}


def score_in_shares(score: Callable[[Batch, list[str]], torch.Tensor], rows: dict[str, list],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """(collective over ``group``, every rank holding the same ``rows``, as ``reward_model_inputs`` makes
    them) ``score`` of every row: each rank scores a contiguous share, and a sum over ``group`` gives every
    rank all of them. -> [n] float32"""
    n, world, rank = len(rows["text"]), dist.get_world_size(group), dist.get_rank(group)
    lo, hi = n * rank // world, n * (rank + 1) // world
    share = Batch({}, {"chat": rows["chat"][lo:hi], "extra_info": rows["extra_info"][lo:hi]})
    scores = torch.zeros(n)  # [n]
    scores[lo:hi] = score(share, rows["text"][lo:hi]).float().cpu()
    dist.all_reduce(scores, group=group)  # each row is one rank's, the others add 0
    return scores


def scored_at_rollout(cfg: "Config") -> bool:
    """Whether split placement's rollout ranks need the reward model's score as they generate (DAPO's
    dynamic sampling keeps groups by it; ReMax's greedy baseline is scored with it): they then ask the
    training ranks for it (``AskedModelReward``), and the training ranks add nothing to the batch."""
    from spmdrl.algos.registry import ADVANTAGES

    return cfg.reward_model.enable and cfg.rollout.placement == "split" and (
        cfg.algorithm.filter_groups.enable
        or bool(ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_baseline")))


class AskedModelReward:
    """(split placement's rollout ranks) The reward model's score of this rank's rows, asked of the training
    ranks that hold the model (``ask``: split placement's exchange; collective: every rollout rank asks for
    every batch, with no rows too, so the training ranks answer all of them at once)."""

    name, collective = "rm", True
    ask: Optional[Callable[[dict[str, list]], torch.Tensor]] = None  # Rewards.connect

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores:
        assert self.ask is not None, "Rewards.connect gives the asked reward model its exchange"
        scores = self.ask(reward_model_inputs(batch, texts))  # [N]
        metrics = {"reward/rm_score/mean": float(scores.mean())} if len(scores) else {}
        return SourceScores(scores, metrics)


class ToolReward:
    """What the tools of a multi-turn trajectory add to its score (their ``calc_reward``)."""

    name, collective, weight = "tool", False, 1.0

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores:
        return SourceScores(batch["tool_reward"])  # [N]


class OverlongPenalty:
    """DAPO's soft penalty for responses that run into ``data.max_response_length`` (or
    ``reward.overlong_buffer.max_resp_len``)."""

    name, collective, weight = "overlong", False, 1.0

    def __init__(self, *, max_response_length: int, buffer_len: int, penalty_factor: float) -> None:
        self.max_response_length, self.buffer_len, self.penalty_factor = (max_response_length, buffer_len,
                                                                          penalty_factor)

    def __call__(self, batch: Batch, texts: Sequence[str]) -> SourceScores:
        # The response's share of max_response_length: generated tokens, and in a multi-turn response the
        # tool output too (the attended response tokens, as verl's DAPO reward counts them).
        R = batch["response_mask"].shape[1]
        lengths = batch["attention_mask"][:, -R:].sum(-1)  # [N]
        penalty = overlong_penalty(lengths, max_response_length=self.max_response_length,
                                   buffer_len=self.buffer_len, penalty_factor=self.penalty_factor)  # [N]
        # verl's dapo manager logs the same two per response (overlong_reward, overlong) with its log flag.
        metrics = {"reward/overlong/mean": float(penalty.mean()),
                   "reward/overlong/ratio": float((penalty < 0).float().mean())} if len(penalty) else {}
        return SourceScores(penalty, metrics)


def build_rewards(cfg: "Config", dims: "ParallelDims", device: torch.device, tokenizer: Any,
                  role: RankRole = RankRole.COLOCATED) -> Optional[Rewards]:
    """The sources the config enables, in the order they are summed (collective over the ranks of
    ``role``). ``role``: which sources this rank holds: every one (colocated), those that need no trained
    model (split placement's rollout ranks) or the reward model (its training ranks; None without one). A
    reward file that does not import, or names no such function, is a ConfigError."""
    role = RankRole(role)
    if role is RankRole.TRAINING and not cfg.reward_model.enable:
        return None
    try:
        partial = role is RankRole.ROLLOUT and cfg.reward_model.enable and not scored_at_rollout(cfg)
        return Rewards(_sources(cfg, dims, device, role), tokenizer, partial=partial)
    except (ValueError, FileNotFoundError, ImportError, AttributeError) as err:
        raise ConfigError(str(err)) from err


def _sources(cfg: "Config", dims: "ParallelDims", device: torch.device, role: RankRole
             ) -> list[RewardSource]:
    rm = cfg.reward_model
    if role is RankRole.TRAINING:
        return [_model_source(cfg, dims, device)]
    sources: list[RewardSource] = []
    rule_weight = rm.rule_weight if rm.enable else 1.0
    if rule_weight != 0:
        sources.append(RuleReward(RewardManager.from_config(cfg.reward), rule_weight, report_mean=rm.enable))
    if rm.enable and role is RankRole.COLOCATED:
        sources.append(_model_source(cfg, dims, device))
    elif role is RankRole.ROLLOUT and scored_at_rollout(cfg):  # the training ranks' model, asked (same place)
        sources.append(AskedModelReward(rm.rm_weight))
    if cfg.rollout.multi_turn.enable:
        sources.append(ToolReward())
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        limit = ob.max_resp_len if ob.max_resp_len is not None else cfg.data.max_response_length
        sources.append(OverlongPenalty(max_response_length=limit, buffer_len=ob.len,
                                       penalty_factor=ob.penalty_factor))
    return sources


def _model_source(cfg: "Config", dims: "ParallelDims", device: torch.device) -> ModelReward:
    from spmdrl.reward.model import RewardModelScorer

    return ModelReward(RewardModelScorer.from_config(cfg, dims, device), cfg.reward_model.rm_weight)
