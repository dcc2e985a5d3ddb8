"""Sequence rewards: score decoded responses with a rule-based function, containing its failures.

    rm = RewardManager.from_config(cfg.reward)       # or RewardManager("my_reward.py:compute_score", num_workers=4)
    out = rm(data_sources, solution_strs, ground_truths, extra_infos)
    out.scores        # [N] float32
    out.metrics()     # {"reward/num_errors": ..., "reward/num_timeouts": ...}   (local counts)

``reward.function`` is ``builtin`` (the scorer registered for each row's
``data_source`` in ``spmdrl.tasks``) or ``path/to/file.py:function`` with
verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`` (a dict must hold ``"score"``; its other
keys come back per item in ``out.extra``).

With ``num_workers=0`` scoring runs in this process: a scorer that raises
scores 0 and is counted, but a scorer that hangs hangs the run. With
``num_workers>0`` each item runs in a worker process (forkserver, or spawn
where that is missing) with a per-item clock of ``timeout_s`` that starts when
the worker receives the item; a worker that overruns is killed and replaced,
and its item scores 0. Workers are our own processes with one pipe each
rather than a concurrent.futures pool, because a futures pool can neither time
an item from the moment it starts nor kill one stuck worker without breaking
the whole pool.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from spmdrl import tasks

# torch is imported inside functions: worker processes import this module, and
# a light import keeps their start-up (which happens again after every kill) fast.
if TYPE_CHECKING:
    import torch

    from spmdrl.config import RewardConfig

log = logging.getLogger(__name__)

# Seconds a fresh worker may take to import the reward function before the batch fails.
_WORKER_START_TIMEOUT_S = 120.0


def load_reward_function(spec: str) -> Callable[..., Any]:
    """``builtin`` -> the data_source dispatcher; ``path/to/file.py:function`` -> that function."""
    if spec == "builtin":
        return tasks.compute_score
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"reward.function={spec!r} is neither 'builtin' nor 'path/to/file.py:function'")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"reward file {str(file)!r} (reward.function={spec!r}) does not exist")
    module_name = f"spmdrl_user_reward_{abs(hash(str(file.resolve())))}"
    mod_spec = importlib.util.spec_from_file_location(module_name, file)
    if mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"reward file {str(file)!r} (reward.function={spec!r}) cannot be imported as Python")
    module = importlib.util.module_from_spec(mod_spec)
    # Registered before running it, as importlib documents: dataclasses and pickle look modules up there.
    sys.modules[module_name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ImportError(f"importing reward file {str(file)!r} (reward.function={spec!r}) failed: {e!r}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"reward file {str(file)!r} has no function {name!r} (reward.function={spec!r}); "
            f"callables defined there: {', '.join(defined) or 'none'}"
        )
    return fn


def _plain(value: Any) -> Any:
    """A picklable, loggable version of an extra value returned by a scorer."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(value)


def _normalise(result: Any) -> tuple[float, dict[str, Any]]:
    """(score, extras) from a scorer's float or dict; a bad return value raises so it is counted as an error."""
    extra: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without 'score': keys {sorted(result)}")
        extra = {str(k): _plain(v) for k, v in result.items() if k != "score"}
        result = result["score"]
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, extra


def _call(fn: Callable[..., Any], item: tuple) -> tuple[float, dict[str, Any]]:
    data_source, solution_str, ground_truth, extra_info = item
    # Keywords, as verl calls it, so user functions may order or default their parameters freely.
    return _normalise(fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                         extra_info=extra_info))


def _worker_main(conn: multiprocessing.connection.Connection, spec: str) -> None:
    """Worker process: load the function, announce readiness, then score items until told to stop."""
    try:
        fn: Optional[Callable[..., Any]] = load_reward_function(spec)
        load_error = ""
    except Exception as e:  # reported per item, so the parent need not special-case start-up
        fn, load_error = None, f"{type(e).__name__}: {e}"
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, item = msg
        try:
            if fn is None:
                raise RuntimeError(load_error)
            score, extra = _call(fn, item)
            conn.send(("ok", idx, score, extra))
        except Exception as e:
            conn.send(("error", idx, f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx: Any, spec: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True, name="spmdrl-reward")
        self.proc.start()
        child.close()
        self.ready = False
        self.born = time.monotonic()
        self.item: Optional[int] = None  # index of the item being scored
        self.started = 0.0  # when that item was sent

    def send(self, idx: int, item: tuple) -> None:
        self.conn.send((idx, item))
        self.item, self.started = idx, time.monotonic()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=2)
        self.kill()


@dataclass
class _Result:
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    timed_out: bool = False


class _WorkerPool:
    """``num_workers`` scoring processes, each fed one item at a time and replaced when it hangs or dies."""

    def __init__(self, spec: str, num_workers: int, timeout_s: float) -> None:
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, timeout_s
        self.workers: list[_Worker] = []

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.ctx, self.spec)

    def run(self, items: Sequence[tuple]) -> list[_Result]:
        while len(self.workers) < self.num_workers:
            self.workers.append(_Worker(self.ctx, self.spec))
        results = [_Result() for _ in items]
        pending = deque(range(len(items)))
        while pending or any(w.item is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.item is None and pending:
                    idx = pending.popleft()
                    try:
                        w.send(idx, items[idx])
                    except OSError:  # died while idle; retry the item on its replacement
                        pending.appendleft(idx)
                        self._replace(w)
            now = time.monotonic()
            deadlines = [w.started + self.timeout_s for w in self.workers if w.item is not None]
            deadlines += [w.born + _WORKER_START_TIMEOUT_S for w in self.workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            ready = multiprocessing.connection.wait([w.conn for w in self.workers], timeout=wait_s)
            for w in [w for w in self.workers if w.conn in ready]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the process died (crash, os._exit, OOM kill)
                    w.proc.join(timeout=1)  # reap it, so the exit code is known for the message
                    if not w.ready:  # before loading anything: respawning would only repeat it
                        self.close()
                        raise RuntimeError(
                            f"a reward worker exited during start-up (exit code {w.proc.exitcode}, "
                            f"reward.function={self.spec!r})"
                        ) from None
                    if w.item is not None:
                        results[w.item].error = f"reward worker died (exit code {w.proc.exitcode})"
                    self._replace(w)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    continue
                res = results[msg[1]]
                if msg[0] == "ok":
                    res.score, res.extra = msg[2], msg[3]
                else:
                    res.error = msg[2]
                w.item = None
            now = time.monotonic()
            for w in list(self.workers):
                if w.item is not None and now - w.started >= self.timeout_s:
                    results[w.item].timed_out = True
                    results[w.item].error = f"timed out after {self.timeout_s:g} s (reward.timeout_s)"
                    self._replace(w)
                elif not w.ready and now - w.born >= _WORKER_START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(
                        f"a reward worker did not start within {_WORKER_START_TIMEOUT_S:g} s "
                        f"(reward.function={self.spec!r})"
                    )
        return results

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


@dataclass
class RewardOutput:
    """Scores of one batch on this rank, aligned with the inputs."""

    scores: "torch.Tensor"  # [N] float32; 0 where scoring raised or timed out
    extra: dict[str, list]  # per-item extra values of dict-returning scorers; None where an item lacks the key
    num_errors: int  # items whose scorer raised, returned a bad value, or whose worker died (timeouts included)
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
        self._pool = _WorkerPool(function, num_workers, timeout_s) if num_workers > 0 else None

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
                tasks.get_scorer(ds)
        items = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        results = self._pool.run(items) if self._pool is not None else [self._score_here(it) for it in items]

        keys = sorted({k for r in results for k in r.extra})
        errors = [r.error for r in results if r.error]
        out = RewardOutput(
            scores=torch.tensor([r.score for r in results], dtype=torch.float32),  # [N]
            extra={k: [r.extra.get(k) for r in results] for k in keys},
            num_errors=len(errors),
            num_timeouts=sum(r.timed_out for r in results),
            errors=errors,
        )
        if errors:
            log.warning("%d of %d rewards failed and scored 0 (first: %s)", len(errors), n, errors[0])
        return out

    def _score_here(self, item: tuple) -> _Result:
        try:
            score, extra = _call(self._fn, item)
            return _Result(score, extra)
        except Exception as e:
            return _Result(error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Stop the worker processes (they are daemons, so exiting the program also ends them)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def decode_responses(tokenizer: Any, response_ids: "torch.Tensor", response_mask: "torch.Tensor") -> list[str]:
    """Response texts for scoring: the masked tokens of each row [N, R], special tokens (EOS) removed."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
