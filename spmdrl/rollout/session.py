"""The one owner of the rollout engine's wake / load / generate / sleep order (docs/design.md, "Weight sync
order").

    session = RolloutSession(engine, lambda: actor.export_weights(dtype), sleep_level=1, sleeps=True)
    with session.awake():
        out = session.generate(prompts, sampling)      # this rank's share of the responses
    session.actor_changed()                            # after an update: load the new weights next time
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from spmdrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, tp_share

Export = Callable[[], Iterable[tuple[str, torch.Tensor]]]  # (hf name, full tensor), one at a time


class RolloutSession:
    """The one owner of the rollout order, so that no path generates from freed or stale weights:

        with session.awake():        # wake weights, load the actor's when they are stale, wake KV cache
            out = engine.generate(...)   # any number of calls: DAPO rounds, ReMax baselines, validation
        # here the engine sleeps (colocated runs), at ``sleep_level``

    Weights are stale after the actor trained (``actor_changed``), after a resume,
    and after a level-2 sleep freed them.
    """

    def __init__(self, engine: RolloutEngine, export: Optional[Export], *, sleep_level: int, sleeps: bool,
                 tp_rank: int = 0, tp: int = 1):
        """``export``: the actor's weights when they are stale (None: a split placement's rollout rank, whose
        weights arrive with ``actor_changed(export)``); ``sleeps``: the engine sleeps after each awake window
        (trainer.sleep_rollout and rollout.free_cache_engine, colocated)."""
        if sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level is {sleep_level}; valid levels: 1, 2")
        if not 0 <= tp_rank < tp:
            raise ValueError(f"rollout TP rank {tp_rank} is outside a TP group of {tp}")
        self.engine, self._export = engine, export
        self.sleep_level, self.sleeps = sleep_level, sleeps
        self.tp_rank, self.tp = tp_rank, tp
        self.stale = False  # the engine was built from the same folder as the actor
        self._depth = 0

    def actor_changed(self, export: Optional[Export] = None) -> None:
        """The trained weights changed: load them at the next wake, from ``export`` from now on when given
        (split placement: the weights the training ranks sent)."""
        self.stale = True
        if export is not None:
            self._export = export

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """This rank's share of the responses to ``prompts`` (inside ``awake``). Every rank of a rollout TP
        group passes the group's prompts; each keeps ``tp_share`` of them, so the batch ends up sharded over
        the world in rollout order (docs/design.md, "Meshes"). With tp == 1 that is every row."""
        if not self._depth:
            raise RuntimeError("RolloutSession.generate called outside `with session.awake():`")
        out = self.engine.generate(prompts, sampling)
        if self.tp == 1:
            return out
        share = tp_share(len(prompts), self.tp_rank, self.tp)
        keep = (out.prompt_index >= share.start) & (out.prompt_index < share.stop)  # [N]
        return out.select(keep.nonzero().squeeze(-1))

    def share(self, num_prompts: int) -> int:
        """How many of a TP group's ``num_prompts`` prompts this rank keeps the responses of."""
        return len(tp_share(num_prompts, self.tp_rank, self.tp))

    @contextlib.contextmanager
    def awake(self, sync_phase: Callable[[], ContextManager] = contextlib.nullcontext,
              sleep_phase: Callable[[], ContextManager] = contextlib.nullcontext) -> Iterator[RolloutEngine]:
        """The engine, awake with the actor's current weights; ``sync_phase`` times the wake and load,
        ``sleep_phase`` the sleep after the window (on a GPU a level-1 sleep copies the weights to the host:
        untimed, it was time in no phase)."""
        if self._depth:  # already awake: an inner caller shares the outer window
            yield self.engine
            return
        with sync_phase():
            self.engine.wake_up(("weights",))
            if self.stale:
                if self._export is None:
                    raise RuntimeError("the rollout engine's weights are stale and nothing exports new ones")
                self.engine.update_weights(self._export())
                self.stale = False
            self.engine.wake_up(("kv_cache",))
        self._depth += 1
        try:
            yield self.engine
        finally:
            self._depth -= 1
            if self.sleeps:
                with sleep_phase():
                    self.engine.sleep(self.sleep_level)
                self.stale = self.stale or self.sleep_level == 2
