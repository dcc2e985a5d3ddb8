"""configs/grpo_tools.yaml under torchrun on 2 ranks with a deterministic policy
(tests/e2e/scripted_policy.py): tool calls are parsed, executed, masked and scored; the metrics count
them. Mechanics, not learning. Colocated, and under split placement (1 rollout rank runs the agent and
its tools, 1 training rank trains, one update apart). Both runs are in the shared 2-rank job, whose driver
registers the scripted policy (tests/e2e/shared_runs.py, matrix_driver.py)."""

from __future__ import annotations

import pytest
from shared_runs import declare

SPLIT = ["--rollout.placement", "split", "--rollout.n_gpus_per_node", "1"]
for _name, _placement in (("colocated", []), ("split", SPLIT)):
    declare(f"multiturn/{_name}", [
        "--config", "configs/grpo_tools.yaml", "--rollout.engine", "scripted", "--data.train_batch_size", "4",
        "--actor.ppo_mini_batch_size", "4", "--rollout.n", "4", "--data.max_response_length", "160",
        "--trainer.total_steps", "2", "--trainer.test_freq", "-1", "--trainer.progress_bar", "false",
        "--trainer.resume", "off", "--trainer.output_dir", f"{{base}}/multiturn/{_name}",
        "--rollout.multi_turn.tool_num_workers", "1", *_placement])


@pytest.mark.e2e
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_grpo_tools_two_ranks_scripted_policy(shared, placement):
    rows = shared.rows(f"multiturn/{placement}")
    assert [r["step"] for r in rows] == [1, 2]
    for m in rows:
        # Per prompt the script makes samples 0, 2, 3 call the tool (2 and 3 badly) and sample 1 answer at
        # once.
        assert m["multi_turn/turns/mean"] == 1.75 and m["multi_turn/turns/max"] == 2
        assert m["multi_turn/tool_calls/mean"] == 0.75
        assert m["multi_turn/tool_errors/mean"] == 0.5 and m["multi_turn/tool_timeouts/mean"] == 0
        # Only sample 0 answers right (1.0); the others score 0.1 ("Answer: 0"): the scorer saw the
        # conversation.
        assert abs(m["reward/mean"] - (1.0 + 3 * 0.1) / 4) < 1e-6
        assert m["reward/acc"] == 0.25 and m["reward/tool_used"] == 0.25
        # A phase inside the rollout phase (under split, the rollout rank's timing is logged under a prefix).
        timing = "rollout_ranks/timing/" if placement == "split" else "timing/"
        assert 0 < m[f"{timing}rollout/tools"] < m[f"{timing}rollout"]
        # Response length counts generated tokens only: the script's texts, not the tool turns between them.
        assert m["response_length/mean"] < m["response_length/max"] <= 160
