"""Every shipped experiment config has a run: the algorithm configs in the combination matrix
(test_matrix.py, 2 ranks), and configs/grpo_tools.yaml here as shipped, its tools driven by the native
engine and the real tiny model for 3 steps on one rank, in the shared jobs (tests/e2e/shared_runs.py; the
matrix's multi-turn cases use a scripted policy)."""


import pytest
from conftest import REPO, TINY
from shared_runs import declare
from test_matrix import CONFIGS, REQUIRED

pytestmark = pytest.mark.e2e


def test_every_algorithm_has_a_config_and_the_matrix_runs_it():
    shipped = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert {"grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_pp", "remax", "gspo", "gpg"} <= shipped
    assert set(CONFIGS) == shipped - {"sft", "grpo_tools"}  # sft.yaml is spmdrl.sft's (test_sft_run.py)


declare("grpo_tools", ["--config", "configs/grpo_tools.yaml", *TINY, "--trainer.total_steps", "3",
                       "--rollout.n", "4", "--trainer.output_dir", "{base}/grpo_tools"], nproc=1)


def test_grpo_tools_runs_three_steps(shared):
    out, rows = shared.path("grpo_tools"), shared.rows("grpo_tools")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in [*REQUIRED, "multi_turn/turns/mean", "multi_turn/tool_calls/mean"]:
        assert key in rows[-1], f"metric {key} missing"
    assert (out / "config.yaml").is_file()
