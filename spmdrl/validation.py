"""Validation metrics as verl reports them: mean@k, best@k, worst@k, maj@k and pass@k per data source.

    metrics = validation_metrics(experience, val_loader)   # every rank; the same dict on every rank

Every validation prompt gets ``rollout.val_kwargs.n`` responses. Each response
carries a few numbers: ``reward`` (the sequence score) and every number a
scorer returns next to its score (``acc``, ...); a scorer's ``pred`` (its
extracted answer) is the vote of majority voting. For each prompt and variable
(verl's ``process_validation_metrics``):

- ``mean@n``, ``std@n``: over the prompt's n responses;
- for k in 2, 4, 8, ... < n and k = n: ``best@k/mean``, ``best@k/std``,
  ``worst@k/...`` (max / min of k responses drawn with replacement, bootstrapped
  1000 times), ``maj@k/mean``, ``maj@k/std`` (the value of the most voted
  ``pred`` among k drawn responses; where the scorer returns ``pred``);
- ``pass@k`` (spmdrl's addition): the unbiased estimator 1 - C(n-c, k) / C(n, k)
  of "one of k responses is right", c the responses whose value is 1; only for a
  variable that is 0/1 on every response of the source (e.g. ``acc``).

Each is averaged over the source's prompts. Names are verl's:
``val-core/<source>/<var>/<metric>`` for the core variable (``acc`` where a
scorer returns it, else ``reward``) and mean/maj/best (and pass) at k = n,
``val-aux/...`` for everything else.

All n responses of a prompt sit on one rank (docs/design.md), so the per-prompt
numbers are rank-local and seeded per prompt; only the per-source sums and
counts cross ranks, so one rank and k ranks agree up to float rounding.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.experience import VALIDATION_STREAM, sampling_params
from spmdrl.reward.sources import response_texts, reward_model_inputs, score_in_shares

if TYPE_CHECKING:
    from spmdrl.data import ValidationLoader
    from spmdrl.experience import Experience
    from spmdrl.reward.sources import Rewards

BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 42  # verl's; the same for every prompt so a prompt's numbers do not depend on its rank
# Metric families that verl shows under val-core (at the largest k); pass is ours.
CORE_FAMILIES = ("mean", "maj", "best", "pass")

Key = tuple[str, str, str]  # (data source, variable, metric name)


def sample_sizes(n: int) -> list[int]:
    """The k of best@k / maj@k / pass@k for n responses: powers of 2 below n, then n (verl's choice)."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n > 1 else []


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of n responses, c of them right, hold a right
    one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_value(values: Sequence[float], preds: Sequence[Any]) -> float:
    """The value of the first response whose ``pred`` has the most votes; a tie goes to the pred seen
    first."""
    counts = Counter(preds)  # insertion-ordered: max() keeps the first of equal counts, as verl's dict does
    winner = max(counts, key=counts.__getitem__)
    return float(values[list(preds).index(winner)])


def bootstrap_majority(values: np.ndarray, preds: Sequence[Any], k: int, *, samples: int = BOOTSTRAP_SAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """``majority_value`` of each of ``samples`` draws of k responses (the same draws as ``bootstrap``): [S].

    Vectorised: in each draw, the first position whose answer has the most votes is the first occurrence of
    the first-seen majority answer, so its value is the one ``majority_value`` returns.
    """
    codes = np.unique(np.array([str(p) for p in preds], dtype=object),
                      return_inverse=True)[1].reshape(-1)  # [n]
    idx = np.random.RandomState(seed).randint(0, len(values), size=(samples, k))  # [S, k]
    drawn = codes[idx]  # [S, k]
    votes = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)  # [S, k] votes of the answer at each position
    first = (votes == votes.max(1, keepdims=True)).argmax(1)  # [S]
    return np.asarray(values, dtype=np.float64)[idx[np.arange(samples), first]]


def bootstrap(values: Sequence[float], k: int, reduce: Callable[[np.ndarray], np.ndarray],
              *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Mean and std of ``reduce`` over ``samples`` draws of k values with replacement (vectorised)."""
    idx = np.random.RandomState(seed).randint(0, len(values), size=(samples, k))  # [S, k]
    stats = reduce(np.asarray(values, dtype=np.float64)[idx])  # [S]
    return float(stats.mean()), float(stats.std())


def prompt_metrics(values: Sequence[float], preds: Optional[Sequence[Any]] = None, *,
                   samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """One prompt's metrics of one variable over its n responses (names as verl's
    ``process_validation_metrics``)."""
    n = len(values)
    arr = np.asarray(values, dtype=np.float64)  # [n]
    out = {f"mean@{n}": float(arr.mean())}
    if n == 1:
        return out
    out[f"std@{n}"] = float(arr.std())
    correct = int(np.isclose(arr, 1.0).sum())
    for k in sample_sizes(n):
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = bootstrap(arr, k, lambda x: x.max(1), samples=samples,
                                                                seed=seed)
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = bootstrap(arr, k, lambda x: x.min(1), samples=samples,
                                                                  seed=seed)
        if preds is not None:
            maj = bootstrap_majority(arr, preds, k, samples=samples, seed=seed)  # [S]
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
        out[f"pass@{k}"] = pass_at_k(n, correct, k)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float)) and math.isfinite(float(v))


def local_sums(data_sources: Sequence[str], uids: Sequence[Any], infos: dict[str, Sequence[Any]], *,
               samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[Key, list[float]]:
    """Per (source, variable, metric): [sum over this rank's prompts, number of prompts].

    ``infos`` maps a variable name to one value per response (``reward`` and the scorer's extras); the
    responses of a prompt share its uid. A variable is used for a prompt when every one of its responses
    has a finite number (a failed scorer leaves None); ``pred`` is the vote, never a variable. The key
    (source, var, "binary") counts prompts whose values are all 0 or 1, so pass@k can be kept only where
    the whole source is 0/1.
    """
    groups: dict[tuple[str, Any], list[int]] = defaultdict(list)
    for row, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[(str(source), uid)].append(row)
    sums: dict[Key, list[float]] = defaultdict(lambda: [0.0, 0.0])
    preds_all = infos.get("pred")
    for (source, _), rows in groups.items():
        preds = [preds_all[i] for i in rows] if preds_all is not None else None
        if preds is not None and any(p is None for p in preds):
            preds = None  # a response without an answer cannot vote
        for var, column in infos.items():
            if var == "pred":
                continue
            values = [column[i] for i in rows]
            if not all(_is_number(v) for v in values):
                continue
            values = [float(v) for v in values]
            for metric, value in prompt_metrics(values, preds, samples=samples, seed=seed).items():
                acc = sums[(source, var, metric)]
                acc[0] += value
                acc[1] += 1
            binary = sums[(source, var, "binary")]
            binary[0] += float(all(v in (0.0, 1.0) for v in values))
            binary[1] += 1
    return dict(sums)


def _k_of(metric: str) -> int:
    return int(metric.split("@")[1].split("/")[0])


def name_metrics(sums: dict[Key, list[float]]) -> dict[str, float]:
    """World-wide sums -> verl's metric names, the per-prompt means of each metric."""
    binary = {(s, v) for (s, v, m), (total, count) in sums.items() if m == "binary" and total == count}
    per_var: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for (source, var, metric), (total, count) in sums.items():
        if metric == "binary" or (metric.startswith("pass@") and (source, var) not in binary):
            continue
        per_var[(source, var)][metric] = total / count
    out: dict[str, float] = {}
    for (source, var), metrics in sorted(per_var.items()):
        core_var = "acc" if (source, "acc") in per_var else "reward"
        n_max = max(_k_of(m) for m in metrics)
        for metric, value in sorted(metrics.items()):
            core = var == core_var and metric.startswith(CORE_FAMILIES) and _k_of(metric) == n_max
            out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{metric}"] = value
    return out


def all_reduce_sums(sums: dict[Key, list[float]],
                    group: Optional[dist.ProcessGroup]) -> dict[Key, list[float]]:
    """Sum every rank's per-key [sum, count]; ranks may hold different keys (sources, variables)."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sums, group=group)
    total: dict[Key, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for per_rank in gathered:  # rank order, so every rank adds in the same order and gets the same floats
        for key, (s, c) in per_rank.items():
            total[key][0] += s
            total[key][1] += c
    return dict(total)


@dataclass
class ValidationRows:
    """This rank's scored validation responses, a value per row: the data source, the prompt's uid and the
    numbers (``reward`` and the scorer's extras). ``model_inputs``: what a reward model that scores
    elsewhere needs of each row (split placement's training ranks: ``chat``, ``text``, ``extra_info``).
    JSON-able: a split placement's rollout ranks send it to the training ranks."""

    sources: list[str] = field(default_factory=list)
    uids: list[int] = field(default_factory=list)
    infos: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    model_inputs: Optional[dict[str, list[Any]]] = None

    def add(self, batch: Batch, extras: dict[str, list], texts: Optional[Sequence[str]] = None) -> None:
        """One scored batch's rows (``texts``: their decoded responses, kept when ``model_inputs`` is)."""
        before = len(self.sources)
        self.sources += [str(s) for s in batch["data_source"]]
        self.uids += batch["index"].tolist()
        self.infos["reward"] += batch["scores"].tolist()
        self._extend(extras, before)
        if self.model_inputs is not None:
            for key, values in reward_model_inputs(batch, texts).items():
                self.model_inputs[key] += values

    def _extend(self, columns: dict[str, list], before: int) -> None:
        """``columns``' values after the first ``before`` rows (a key new here: None in those rows)."""
        for key, values in columns.items():
            column = self.infos[key]
            column += [None] * (before - len(column)) + list(values)

    def done(self) -> "ValidationRows":
        for column in self.infos.values():
            column += [None] * (len(self.sources) - len(column))
        return self

    def metrics(self, group: Optional[dist.ProcessGroup]) -> dict[str, float]:
        """verl's val-core / val-aux metrics of every rank's rows in ``group`` (None: of these rows alone)."""
        sums = local_sums(self.sources, self.uids, self.infos)
        return name_metrics(all_reduce_sums(sums, group) if group is not None else sums)

    def add_model_scores(self, rewards: "Rewards", group: dist.ProcessGroup) -> None:
        """(split placement's training ranks, collective over ``group``) The reward model's weighted score
        added to each row's ``reward``: each rank scores a contiguous share of the rows, and a sum over
        ``group`` gives every rank all of them."""
        assert self.model_inputs is not None  # kept next to a reward model (validation_rows)
        scores = score_in_shares(lambda share, texts: rewards.score_texts(share, texts).scores,
                                 self.model_inputs, group)  # [n]
        self.infos["reward"] = (torch.tensor(self.infos["reward"], dtype=torch.float32) + scores).tolist()

    def to_json(self) -> dict[str, Any]:
        return {"sources": self.sources, "uids": self.uids, "infos": dict(self.infos),
                "model_inputs": self.model_inputs}

    @classmethod
    def cat(cls, parts: Sequence[dict[str, Any]]) -> "ValidationRows":
        """Several ranks' ``to_json`` in order as one set of rows (a key one part lacks: None there)."""
        out = cls(model_inputs=defaultdict(list) if parts and parts[0]["model_inputs"] is not None else None)
        for part in parts:
            before = len(out.sources)
            out.sources += part["sources"]
            out.uids += part["uids"]
            out._extend(part["infos"], before)
            for key, values in (part["model_inputs"] or {}).items():
                out.model_inputs[key] += values
        return out.done()


def validation_rows(exp: "Experience", loader: "ValidationLoader") -> ValidationRows:
    """``rollout.val_kwargs`` responses to every validation prompt of this rank, scored (collective: every
    rank calls it). Next to a reward model that scores elsewhere (``Rewards.partial``) the rows keep what
    it needs."""
    sampling = sampling_params(exp.cfg, validation=True)
    rows = ValidationRows(model_inputs=defaultdict(list) if exp.rewards.partial else None)
    with exp.session.awake():  # one wake for every validation batch
        for prompts in loader:
            # A rank with no prompts, or an empty TP share of a last, short batch, still takes part in the
            # scoring's collectives (a reward model's forward, the all-failed check).
            batch = exp.generate(prompts, sampling, VALIDATION_STREAM) if prompts else None
            if batch is None or not len(batch):
                exp.join_score()
                continue
            extras: dict[str, list] = {}
            exp.score(batch, extras)
            keep = rows.model_inputs is not None
            rows.add(batch, extras, response_texts(exp.rewards.tokenizer, batch) if keep else None)
    return rows.done()


def validation_metrics(exp: "Experience", loader: Optional["ValidationLoader"]) -> dict[str, float]:
    """``rollout.val_kwargs`` responses to every validation prompt, scored; verl's val-core / val-aux metrics.
    Collective: every rank calls it; the dict is the same on every rank."""
    if loader is None:
        return {}
    return validation_rows(exp, loader).metrics(exp.group)
