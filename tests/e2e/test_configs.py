"""Every shipped experiment config runs 3 steps of real training on the tiny model."""


import pytest
from conftest import REPO, TINY, read_metrics, train

pytestmark = pytest.mark.e2e

# configs/sft.yaml is spmdrl.sft's, not the RL trainer's: tests/e2e/test_sft_run.py runs it.
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "sft")
REQUIRED = [
    "reward/mean", "reward/max", "reward/min", "response_length/mean", "response_length/clip_ratio",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "perf/tokens_per_s", "timing/rollout", "timing/weight_sync", "timing/reward", "timing/old_logp",
    "timing/ref", "timing/adv", "timing/update", "timing/step", "memory/rollout_peak_gb",
    "memory/update_peak_gb",
]

# Configs for real models and data (not here): run on the tiny model and task, keeping their algorithm.
LOCAL = {"gsm8k_grpo": ["--model.path", "builtin:tiny", "--data.train_files", "builtin:arith",
                        "--data.val_files", "builtin:arith", "--rollout.engine", "native",
                        "--trainer.logger", "[console,jsonl]", "--trainer.val_before_train", "false",
                        "--trainer.test_freq", "-1"]}


def test_every_algorithm_has_a_config():
    assert {"grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_pp", "remax", "gspo", "gpg"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_runs_three_steps(name, tmp_path, spmdrl_cache):
    out = tmp_path / name
    train(["--config", f"configs/{name}.yaml", *LOCAL.get(name, []), *TINY, "--trainer.total_steps", "3",
           "--rollout.n", "4", "--trainer.output_dir", str(out)], cache=spmdrl_cache)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in REQUIRED:
        assert key in rows[-1], f"{name}: metric {key} missing"
    if name == "ppo":
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"} <= set(rows[-1])
    if name == "dapo":
        assert "dapo/num_gen_batches" in rows[-1]
    assert (out / "config.yaml").is_file()
