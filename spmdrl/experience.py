"""Experience: prompts in, a scored batch out, below the loop and shared by training and validation.

    exp = Experience.from_config(cfg, dims, device, tokenizer, rewards, timer, export_weights=actor_export)
    batch, metrics = exp.produce(prompts, more_prompts=train_loader)   # wake, generate, score, sleep
    batch = exp.generate(prompts, sampling_params(cfg, validation=True))  # inside session.awake()
    metrics = exp.score(batch, extras)

One training step's experience (``produce``): the rollout engine wakes with the
actor's current weights (``RolloutSession``), generates ``rollout.n`` responses
per prompt (single-turn, or multi-turn with tools through ``ToolAgent``), the
reward sources score them (``spmdrl.reward.sources``), DAPO's dynamic sampling
(``algorithm.filter_groups``) generates more prompts until the ranks together
kept a batch of informative groups, ReMax's greedy responses give each prompt
its baseline (``batch["baseline"]``), and the engine sleeps. Also here: the
rollout-vs-actor log-prob gap and the batch's reward and length metrics.

Everything is this rank's share of the batch; the only collectives are DAPO's
count of the groups kept, the placement of the groups on their ranks
(``spmdrl.placement``: rows move only when DAPO or rollout TP left them
elsewhere) and a reward model's forward.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist

from spmdrl.agent.rollout import ToolAgent, annotate, multi_turn_metrics
from spmdrl.algos.dapo import filter_groups
from spmdrl.algos.registry import ADVANTAGES
from spmdrl.batch import Batch, add_scores, from_generation
from spmdrl.errors import ConfigError
from spmdrl.parallel import rollout_tp_rank
from spmdrl.placement import place_groups, slot_prompts
from spmdrl.rollout import rollout_engine_class
from spmdrl.rollout.base import SamplingParams, eos_ids_from_folder, sleep_level
from spmdrl.rollout.generations import dump_generations
from spmdrl.rollout.sampling import response_key
from spmdrl.rollout.session import Export, RolloutSession

if TYPE_CHECKING:
    from spmdrl.config import Config
    from spmdrl.data import PromptItem
    from spmdrl.metrics import PhaseTimer
    from spmdrl.parallel import ParallelDims
    from spmdrl.reward.sources import Rewards

log = logging.getLogger("spmdrl")


# Streams of sampling keys: a training step's rollouts and a validation's draw different noise.
TRAIN_STREAM, VALIDATION_STREAM = 0, 1


def sampling_params(cfg: "Config", *, validation: bool = False) -> SamplingParams:
    """Training sampling (``rollout.*``), or validation sampling (``rollout.val_kwargs``)."""
    r = cfg.rollout
    if validation:
        v = r.val_kwargs  # verl: do_sample false is greedy whatever the temperature
        return SamplingParams(n=v.n, max_tokens=cfg.data.max_response_length,
                              temperature=v.temperature if v.do_sample else 0.0, top_p=v.top_p, top_k=v.top_k,
                              logprobs=False)  # validation scores responses only
    return SamplingParams(n=r.n, max_tokens=cfg.data.max_response_length, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, ignore_eos=r.ignore_eos,
                          logprobs=r.calculate_log_probs)


class Experience:
    """Turns this rank's prompts into scored batches with its rollout session, agent and reward sources."""

    def __init__(self, cfg: "Config", session: RolloutSession, rewards: "Rewards", *, timer: "PhaseTimer",
                 group: dist.ProcessGroup, agent: Optional[ToolAgent] = None,
                 needs_baseline: bool = False) -> None:
        self.cfg, self.session, self.rewards, self.timer = cfg, session, rewards, timer
        self.group, self.agent, self.needs_baseline = group, agent, needs_baseline
        self.failures: list[str] = []  # reward failures of the step so far (pop_failures)
        self.step = 0  # the step whose experience is produced (part of every sampling key; set by the loop)

    @classmethod
    def from_config(cls, cfg: "Config", dims: "ParallelDims", device: torch.device, tokenizer: Any,
                    rewards: "Rewards", timer: "PhaseTimer", *,
                    export_weights: Optional[Export]) -> "Experience":
        """This rank's rollout engine (``rollout.engine``, on the rollout mesh) behind its session, the
        multi-turn agent when tools are on, and ``rewards``; ``export_weights`` streams the actor's weights
        into the engine when they are stale (None: split placement's rollout ranks, which load the weights
        the training ranks send)."""
        eos_ids = eos_ids_from_folder(cfg.model.path, tokenizer.eos_token_id)
        engine = rollout_engine_class(cfg.rollout.engine).from_config(
            cfg, cfg.model.path, mesh=dims.rollout_mesh, device=device,
            pad_token_id=tokenizer.pad_token_id or 0, eos_token_ids=eos_ids,
        )
        agent = ToolAgent.from_config(cfg, tokenizer, eos_ids) if cfg.rollout.multi_turn.enable else None
        # Colocated, the engine sleeps after each awake window unless rollout.free_cache_engine keeps it
        # awake; a split placement's rollout rank has nothing to make room for.
        session = RolloutSession(engine, export_weights, sleep_level=sleep_level(cfg, device.type),
                                 sleeps=cfg.trainer.sleep_rollout and cfg.rollout.free_cache_engine
                                 and not dims.split,
                                 tp_rank=rollout_tp_rank(dims.rollout_mesh), tp=dims.rollout_tp)
        needs_baseline = bool(ADVANTAGES.meta(cfg.algorithm.adv_estimator).get("needs_baseline"))
        return cls(cfg, session, rewards, timer=timer, group=dims.batch_group, agent=agent,
                   needs_baseline=needs_baseline)

    def generate(self, prompts: list["PromptItem"], sampling: SamplingParams, stream: int = TRAIN_STREAM,
                 draw: int = 0) -> Batch:
        """Rollout of this rank's rollout-DP prompts; call inside ``session.awake()``. Under rollout TP the
        rank keeps its share of the TP group's responses (``RolloutSession.generate``). Each prompt's
        sampling noise is keyed by (trainer.seed, ``stream``, the step, ``draw`` (DAPO's generation round,
        the same on every rank), its stable id), so a response is the same whichever rank draws it, on any
        world size (SamplingParams.keys)."""
        ids = [p.prompt_ids for p in prompts]
        if not sampling.greedy:
            seed = self.cfg.trainer.seed
            sampling = replace(sampling, keys=tuple(response_key(seed, stream, self.step, draw, p.index)
                                                    for p in prompts))
        if self.agent is not None:  # turns of the same engine calls, with tool output between them
            gen, trajectories = self.agent.generate(self.session.generate, ids, sampling,
                                                    [p.extra_info for p in prompts],
                                                    tool_phase=lambda: self.timer.phase("tools"))
        else:
            gen, trajectories = self.session.generate(ids, sampling), None
        batch = from_generation(gen, torch.tensor([p.index for p in prompts], dtype=torch.long))
        batch["order"] = torch.tensor([p.order for p in prompts], dtype=torch.long)[gen.prompt_index]  # [N]
        if sampling.logprobs:  # [N, R] under the sampling distribution (rollout/sampling.py)
            batch["rollout_logp"] = gen.logprobs
        per_row = gen.prompt_index.tolist()
        batch["data_source"] = [prompts[i].data_source for i in per_row]
        batch["ground_truth"] = [prompts[i].ground_truth for i in per_row]
        batch["extra_info"] = [prompts[i].extra_info for i in per_row]
        batch["chat"] = [prompts[i].chat for i in per_row]  # a reward model renders prompt + response itself
        batch["finish_reason"] = gen.finish_reasons
        if trajectories is not None:
            annotate(batch, trajectories)  # conversation and tool calls into extra_info; per-row tool counts
        return batch

    def score(self, batch: Batch, extras: Optional[dict[str, list]] = None) -> dict[str, float]:
        """The weighted sum of the reward sources into ``scores`` [N] and ``token_rewards`` [N, R]; a scorer's
        per-response extra values (``acc``, ``pred``, ...) into ``extras`` when given (validation votes)."""
        result = self.rewards(batch)
        add_scores(batch, result.scores)
        if extras is not None:
            extras.update(result.extra)
        self._check_failures(result.errors, len(batch))
        return result.metrics

    def join_score(self) -> None:
        """Take part in ``score``'s collectives with no rows: a rank whose share of a validation batch is
        empty (a reward model's forward, the all-failed check), so that the others are not left waiting."""
        if self.rewards.collective:
            self.rewards.join_collectives()
        self._check_failures([], 0)

    def _check_failures(self, errors: list[str], rows: int) -> None:
        """A reward function that failed on every response (over all ranks) would train on zero reward:
        stop with one sentence (ConfigError, exit 2). Sporadic failures are kept for the step's one warning
        (``pop_failures``)."""
        self.failures += errors
        counts = torch.tensor([len(errors), rows], dtype=torch.long)
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        failed, total = (int(x) for x in counts)
        if total and failed == total:
            first = errors[0] if errors else "see the rank that scored"
            raise ConfigError(f"reward.function {self.cfg.reward.function!r} failed on every one of the "
                              f"{total} responses of this step (first error: {first}); fix it, or make it "
                              f"return a score for every response")

    def pop_failures(self) -> list[str]:
        """This rank's reward failures since the last call (one warning per step says them)."""
        out, self.failures = self.failures, []
        return out

    def close(self) -> None:
        """Stop the reward and tool workers (the engine closes once every rank is past its collectives)."""
        self.rewards.close()
        if self.agent is not None:
            self.agent.close()

    def warn_failures(self, step: int, rank: int) -> None:
        """Sporadic reward failures of ``step``: it trains on, with one line saying so (reward/num_errors
        counts them); a function failing on every response already stopped the run (``score``)."""
        failures = self.pop_failures()
        if failures:
            log.warning("step %d: %d rewards failed on rank %d and scored 0 (first: %s)", step, len(failures),
                        rank, failures[0])

    def step_batch(self, loader: Iterator[list["PromptItem"]], step: int, tokenizer: Any,
                   dump_to: Optional[Path] = None) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s scored batch of this rank's share, the rollout half of every step (colocated, and
        on split placement's rollout ranks): the loader's next prompts, generated and scored (DAPO's rounds
        draw more of them), written to ``dump_to`` (verl's generation dump), with its batch metrics."""
        with self.timer.phase("data"):
            prompts = next(loader)
        self.step = step  # part of every sampling key: the same samples on any world size and placement
        batch, metrics = self.produce(prompts, more_prompts=loader)
        if dump_to is not None:
            with self.timer.phase("dump"):
                dump_generations(batch, tokenizer, step, dump_to, self.group)
        metrics.update(batch_metrics(batch))
        return batch, metrics

    def produce(self, prompts: list["PromptItem"], more_prompts: Iterator[list["PromptItem"]]
                ) -> tuple[Batch, dict[str, float]]:
        """One step's scored batch: the engine awake for every generation the step needs (DAPO's rounds
        draw from ``more_prompts``; ReMax's greedy baseline), then asleep."""
        with self.session.awake(lambda: self.timer.phase("weight_sync"), lambda: self.timer.phase("sleep")):
            return self._collect(prompts, more_prompts)

    def _round(self, prompts: list["PromptItem"], sampling: SamplingParams, metrics: dict[str, float],
               draw: int) -> Batch:
        """One generation round (``draw`` counts them from 0): rollout, reward and, for ReMax, each prompt's
        greedy baseline ([N]), so that every row carries its own baseline whichever round it came from."""
        with self.timer.phase("rollout"):
            batch = self.generate(prompts, sampling, draw=draw)
        with self.timer.phase("reward"):
            metrics.update(self.score(batch))
        if self.needs_baseline:
            batch["baseline"] = self._greedy_baseline(prompts, batch)  # [N]
        return batch

    def _collect(self, prompts: list["PromptItem"], more_prompts: Iterator[list["PromptItem"]]
                 ) -> tuple[Batch, dict[str, float]]:
        """Rollout + reward; with DAPO dynamic sampling, more prompts until the ranks together kept a batch of
        groups, or the training set's epochs run out (then the groups kept so far). Each rank then holds its
        share of the first kept groups in global prompt order (``place_groups``: the same groups, and the
        same mini-batches, at any world size)."""
        sampling = sampling_params(self.cfg)
        fg = self.cfg.algorithm.filter_groups
        want = self.cfg.data.train_batch_size  # groups the step trains on, over all ranks
        n = self.cfg.rollout.n
        kept: list[Batch] = []
        metrics: dict[str, float] = {}
        rounds = 0
        while True:
            batch = self._round(prompts, sampling, metrics, draw=rounds)
            rounds += 1
            if not fg.enable:
                kept = [batch]
                break
            keep, counts = filter_groups(batch["scores"], batch["index"])
            kept.append(batch.select(keep.nonzero().squeeze(-1)))
            for k, v in counts.items():
                metrics[f"dapo/{k}"] = metrics.get(f"dapo/{k}", 0.0) + v
            # Rollout TP ranks keep disjoint shares of their group's responses: the sum counts each group
            # once.
            have = torch.tensor([sum(len(b) for b in kept) // n], dtype=torch.long)
            dist.all_reduce(have, group=self.group)
            if have.item() >= want or (fg.max_num_gen_batches and rounds >= fg.max_num_gen_batches):
                break
            # Every rank's loader is at the same position, so all of them run out together.
            prompts = next(more_prompts, None)
            if prompts is None:
                break
        if fg.enable:
            metrics["dapo/num_gen_batches"] = float(rounds)
        placed = place_groups(Batch.cat(kept), n, want, slot_prompts(self.cfg), self.group,
                              torch.device("cpu"))  # the batch group's gloo side on either device
        if len(placed) == 0:
            raise RuntimeError(
                f"dynamic sampling kept fewer groups than the {dist.get_world_size(self.group)} ranks after "
                f"{rounds} generation batches; raise algorithm.filter_groups.max_num_gen_batches or make the "
                f"task less all-or-nothing"
            )
        return placed, metrics

    def _greedy_baseline(self, prompts: list["PromptItem"], batch: Batch) -> torch.Tensor:
        """ReMax: the reward of a greedy response to each prompt, as the baseline of its samples [N] (timed
        with the rollout and reward phases)."""
        with self.timer.phase("rollout"):
            greedy = self.generate(prompts, SamplingParams(n=1, max_tokens=self.cfg.data.max_response_length,
                                                           temperature=0.0, logprobs=False))
        with self.timer.phase("reward"):
            self.score(greedy)
        by_prompt = dict(zip(greedy["index"].tolist(), greedy["scores"].tolist()))
        return torch.tensor([by_prompt[i] for i in batch["index"].tolist()], dtype=torch.float32)  # [N]


def rollout_actor_gap(batch: Batch, sampling: SamplingParams) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the actor's recomputation of the same tokens (verl's
    training/rollout_probs_diff_*): a weight-sync or numerics check. Only comparable when the sampling
    distribution is the actor's full one (no top-k / top-p truncation; see rollout/sampling.py)."""
    if not sampling.full_distribution or "rollout_logp" not in batch:
        return {}
    mask = batch["response_mask"].bool()  # [N, R]
    if not mask.any():
        return {}
    rollout, actor = batch["rollout_logp"][mask], batch["old_logp"][mask]  # [tokens]
    probs_diff = (rollout.exp() - actor.exp()).abs()
    return {
        "training/rollout_probs_diff/mean": float(probs_diff.mean()),
        "training/rollout_probs_diff/max": float(probs_diff.max()),
        "training/rollout_logp_diff/max": float((rollout - actor).abs().max()),
    }


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Reward and length statistics of this rank's rows (means are averaged over ranks, max/min reduced)."""
    scores = batch["scores"]
    lengths = batch["response_mask"].sum(-1)
    clipped = torch.tensor([f == "length" for f in batch["finish_reason"]], dtype=torch.float32)
    return {
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(clipped.mean()),
        "batch/responses": float(len(batch)),
        **multi_turn_metrics(batch),
    }

