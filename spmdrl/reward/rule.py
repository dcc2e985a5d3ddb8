"""Sequence rewards: score decoded responses with a rule-based function, containing its failures.

    rm = RewardManager.from_config(cfg.reward)
    # or RewardManager("my_reward.py:compute_score", num_workers=4)
    out = rm(data_sources, solution_strs, ground_truths, extra_infos)
    out.scores        # [N] float32
    out.metrics()     # {"reward/num_errors": ..., "reward/num_timeouts": ...}   (local counts)

``reward.function`` is ``builtin`` (the scorer registered for each row's
``data_source`` in ``spmdrl.reward.scorers``) or ``path/to/file.py:function`` with
verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`` (a dict must hold ``"score"``; its other
keys come back per item in ``out.extra``).

A scorer that raises (or calls ``sys.exit``) scores 0 and is counted. A
scorer that returns something other than a finite number or such a dict
(``None``, a string, NaN) is a bug that would train on zeros: it stops the run
with a ConfigError naming the function and the value.

With ``num_workers=0`` scoring runs in this process, and a scorer that hangs
hangs the run. With ``num_workers>0`` each item runs in a worker process with a
per-item clock of ``timeout_s`` that starts when the item is sent; a worker that
overruns is killed with its every descendant and replaced, and its item scores
0. Workers run at the ``process`` sandbox level with ``REWARD_LIMITS`` (address
space, processes, file size, CPU), in a temporary directory with an allowlisted
environment; items and return values cross as JSON, so ``ground_truth`` and
``extra_info`` reach the function as plain data (numpy arrays as lists) and the
trainer judges the plain return value (the pool is
``spmdrl.sandbox.pool.WorkerPool``).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from spmdrl.errors import ConfigError
from spmdrl.reward import scorers
from spmdrl.sandbox.confine import Limits
from spmdrl.sandbox.pool import Outcome, WorkerPool
from spmdrl.sandbox.userfile import import_file

# torch is imported inside functions: worker processes import this module, and
# a light import keeps their start-up (which happens again after every kill) fast.
if TYPE_CHECKING:
    import torch

    from spmdrl.config import RewardConfig

log = logging.getLogger(__name__)

# Seconds a fresh worker may take to import the reward function before the batch fails.
_WORKER_START_TIMEOUT_S = 120.0
# Limits of a reward worker: more address space than a tool's (verifiers import sympy and the like).
REWARD_LIMITS = Limits(memory_mb=4096)


def load_reward_function(spec: str) -> Callable[..., Any]:
    """``builtin`` -> the data_source dispatcher; ``path/to/file.py:function`` -> that function."""
    if spec == "builtin":
        return scorers.compute_score
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"reward.function={spec!r} is neither 'builtin' nor 'path/to/file.py:function'")
    file = Path(path).expanduser()
    module = import_file(file, "reward", f"reward.function={spec!r}")
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"reward file {str(file)!r} has no function {name!r} (reward.function={spec!r}); "
            f"callables defined there: {', '.join(defined) or 'none'}"
        )
    return fn


def _plain(value: Any) -> Any:
    """A JSON-able, loggable version of an extra value returned by a scorer."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(value)


def _check_signature(fn: Callable[..., Any], function: str) -> None:
    """A function verl's keywords cannot call would raise on every item and score 0 each time: refuse it."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without an inspectable signature: the calls decide
        return
    try:
        signature.bind(data_source=None, solution_str="", ground_truth=None, extra_info=None)
    except TypeError as err:
        raise ConfigError(f"reward.function {function!r} cannot be called as verl calls it, with the "
                          f"keywords data_source, solution_str, ground_truth and extra_info "
                          f"({err})") from None


def _returned(result: Any) -> Any:
    """A scorer's return value as plain data (what crosses from a worker): a dict's values and a lone
    value made plain, so the trainer judges it without unpickling anything of the scorer's."""
    if isinstance(result, dict):
        return {str(k): _plain(v) for k, v in result.items()}
    return _plain(result)


def _normalise(result: Any, function: str, data_source: Any) -> tuple[float, dict[str, Any]]:
    """(score, extras) from a scorer's plain return value; anything but a finite number or a dict holding
    one under "score" is a ConfigError naming ``function`` and the value."""
    score = result.get("score") if isinstance(result, dict) else result
    if isinstance(score, (bool, int, float)) and math.isfinite(score):
        extra = {k: v for k, v in result.items() if k != "score"} if isinstance(result, dict) else {}
        return float(score), extra
    keyless = isinstance(result, dict) and "score" not in result
    what = f"a dict without 'score' (keys {sorted(result)})" if keyless else repr(result)[:200]
    raise ConfigError(f"reward.function {function!r} returned {what} for data_source {data_source!r}; it "
                      f"must return a finite number or a dict with a numeric 'score' (scoring 0 silently "
                      f"would train on wrong rewards)")


def _call(fn: Callable[..., Any], item: tuple) -> Any:
    """The scorer's plain return value for ``item``."""
    data_source, solution_str, ground_truth, extra_info = item
    # Keywords, as verl calls it, so user functions may order or default their parameters freely.
    return _returned(fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                        extra_info=extra_info))


def _worker_setup(spec: str) -> Callable[[tuple], Any]:
    """In a worker process: the scoring function for items ``(data_source, solution, ground_truth,
    extra_info)``; it answers the scorer's plain return value, which the trainer checks."""
    try:
        fn = load_reward_function(spec)
    except Exception as e:  # reported per item, so the pool need not special-case start-up
        load_error = f"{type(e).__name__}: {e}"

        def fail(item: tuple) -> Any:
            raise RuntimeError(load_error)

        return fail
    return lambda item: _call(fn, item)


@dataclass
class _Result:
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    timed_out: bool = False


def _pooled(out: Outcome, function: str, data_source: Any) -> _Result:
    """A worker's outcome as a result: its plain return value judged here, as an in-process one is."""
    if out.error:
        return _Result(error=out.error, timed_out=out.timed_out)
    return _Result(*_normalise(out.value, function, data_source))


@dataclass
class RewardOutput:
    """Scores of one batch on this rank, aligned with the inputs."""

    scores: "torch.Tensor"  # [N] float32; 0 where scoring raised or timed out
    # per-item extra values of dict-returning scorers; None where an item lacks the key
    extra: dict[str, list]
    # items whose scorer raised, returned a bad value, or whose worker died (timeouts included)
    num_errors: int
    num_timeouts: int  # items that ran past reward.timeout_s
    errors: list[str] = field(default_factory=list)  # one message per failed item, for logs

    def metrics(self) -> dict[str, float]:
        """Local counts; the loop sums them over ranks."""
        return {"reward/num_errors": float(self.num_errors), "reward/num_timeouts": float(self.num_timeouts)}


class RewardManager:
    """Scores decoded responses with ``reward.function``, in-process or in a pool of worker processes."""

    def __init__(self, function: str = "builtin", *, num_workers: int = 0, timeout_s: float = 10.0) -> None:
        if num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.function = function
        # Loading here, in the parent, turns a bad path or name into an error before any training work.
        self._fn = load_reward_function(function)
        _check_signature(self._fn, function)
        self._pool = WorkerPool(
            _worker_setup, (function,), num_workers=num_workers, timeout_s=timeout_s, name="reward",
            start_timeout_s=_WORKER_START_TIMEOUT_S, timeout_note="reward.timeout_s",
            context=f"reward.function={function!r}", limits=REWARD_LIMITS,
        ) if num_workers > 0 else None

    @classmethod
    def from_config(cls, cfg: "RewardConfig") -> "RewardManager":
        return cls(cfg.function, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)

    def __call__(
        self,
        data_sources: Sequence[Optional[str]],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Optional[Sequence[Optional[dict]]] = None,
    ) -> RewardOutput:
        import torch

        n = len(solution_strs)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
            raise ValueError(
                f"reward inputs disagree in length: {len(data_sources)} data_sources, {n} solutions, "
                f"{len(ground_truths)} ground truths, {len(extra_infos)} extra_infos"
            )
        if self.function == "builtin":
            # An unknown data source is a data/config mistake, not a flaky scorer: fail loudly, once.
            for ds in sorted(set(map(str, data_sources))):
                scorers.get_scorer(ds)
        items = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        if self._pool is not None:
            results = [_pooled(o, self.function, ds) for o, ds in zip(self._pool.run(items), data_sources)]
        else:
            results = [self._score_here(it) for it in items]

        keys = sorted({k for r in results for k in r.extra})
        errors = [r.error for r in results if r.error]
        out = RewardOutput(
            scores=torch.tensor([r.score for r in results], dtype=torch.float32),  # [N]
            extra={k: [r.extra.get(k) for r in results] for k in keys},
            num_errors=len(errors),
            num_timeouts=sum(r.timed_out for r in results),
            errors=errors,
        )
        return out  # failures are counted and said once per step by the experience (spmdrl/experience.py)

    def _score_here(self, item: tuple) -> _Result:
        try:
            result = _call(self._fn, item)
        # SystemExit too: sys.exit() in a reward function must not end this rank while the others wait.
        except (Exception, SystemExit) as e:
            return _Result(error=f"{type(e).__name__}: {e}")
        return _Result(*_normalise(result, self.function, item[0]))

    def close(self) -> None:
        """Stop the worker processes (they are daemons, so exiting the program also ends them)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def decode_responses(tokenizer: Any, response_ids: "torch.Tensor",
                     response_mask: "torch.Tensor") -> list[str]:
    """Response texts for scoring: the masked tokens of each row [N, R], special tokens (EOS) removed."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
