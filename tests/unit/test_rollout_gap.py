"""The loop's rollout-vs-actor log-prob gap metric (verl's training/rollout_probs_diff_*)."""

import math

import torch

from spmdrl.batch import Batch
from spmdrl.experience import rollout_actor_gap as _rollout_actor_gap
from spmdrl.rollout.base import SamplingParams


def test_gap_over_response_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    rollout = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.1, 1.0, 1.0]]))
    actor = torch.log(torch.tensor([[0.5, 0.20, 0.01], [0.2, 0.01, 0.01]]))  # padding differs wildly: ignored
    batch = Batch({"response_mask": mask, "rollout_logp": rollout, "old_logp": actor})
    m = _rollout_actor_gap(batch, SamplingParams(temperature=1.0))
    assert math.isclose(m["training/rollout_probs_diff/max"], 0.1, rel_tol=1e-6)
    assert math.isclose(m["training/rollout_probs_diff/mean"], (0 + 0.05 + 0.1) / 3, rel_tol=1e-6)
    assert math.isclose(m["training/rollout_logp_diff/max"], math.log(2), rel_tol=1e-6)
    # Under top-k / top-p the rollout's log-probs are the truncated distribution's: not comparable.
    assert _rollout_actor_gap(batch, SamplingParams(top_p=0.9)) == {}
