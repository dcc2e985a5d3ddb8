"""verl's GSM8K GRPO example and its PPO quickstart command lines, unchanged but for local paths and CPU
sizes, for 2 steps on 2 ranks.

The GRPO run serves three checks: its resolved config equals the spmdrl YAML of the same run written by
hand; tensorboard's event file and wandb's offline run folder hold each step's metrics. The PPO quickstart
(docs/start/quickstart.rst: a critic, several mini-batches, verl's defaults for everything else, so no
rollout log-probs) takes its steps with its critic. The runs are in the shared 2-rank job
(tests/e2e/shared_runs.py).
"""

from __future__ import annotations

import json
import math
import shlex
import struct
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from shared_runs import declare, prepare
from verl_recipes import DAPO_ONE_STEP_OFF_POLICY, DAPO_QWEN25_32B, ONE_STEP_OFF_POLICY, gsm8k_parquet

pytestmark = pytest.mark.e2e

# verl's examples/grpo_trainer quickstart, with local model/data paths, trainer.n_gpus_per_node=2 and small
# sizes (batch, response length, n) for CPU. Left out: actor_rollout_ref.rollout.name=vllm (no vLLM in this
# environment; spmdrl's default engine runs). Added: trainer.total_training_steps=2 and the output folder.
VERL_COMMAND = """
    algorithm.adv_estimator=grpo
    data.train_files={data}/train.parquet
    data.val_files={data}/test.parquet
    data.train_batch_size=4
    data.max_prompt_length=512
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=2
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=['console','wandb','tensorboard']
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=2
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    trainer.total_training_steps=2
    trainer.default_local_dir={out}
"""

# The same run in spmdrl's keys, by hand (verl's defaults that differ from spmdrl's spelled out).
SPMDRL_YAML = """
data:
  train_files: {data}/train.parquet
  val_files: {data}/test.parquet
  train_batch_size: 4
  max_prompt_length: 512
  max_response_length: 8
  truncation: filter
model:
  path: {model}
  enable_gradient_checkpointing: true
  use_remove_padding: true
rollout:
  n: 2
  gpu_memory_utilization: 0.6
  calculate_log_probs: false
parallel:
  rollout_tp: 1
actor:
  lr: 1.0e-6
  weight_decay: 0.01
  ppo_mini_batch_size: 4
  ppo_micro_batch_size_per_gpu: 4
  log_prob_micro_batch_size_per_gpu: 8
  use_kl_loss: true
  kl_loss_coef: 0.001
  kl_loss_type: low_var_kl
  entropy_coeff: 0.0
ref:
  offload: true
  log_prob_micro_batch_size_per_gpu: 8
critic:
  lr: 1.0e-5
  weight_decay: 0.01
  ppo_mini_batch_size: 4
algorithm:
  adv_estimator: grpo
  use_kl_in_reward: false
trainer:
  project_name: verl_grpo_example_gsm8k
  experiment_name: qwen2_7b_function_rm
  output_dir: {out}
  logger: [console, jsonl, wandb, tensorboard]
  total_epochs: 15
  total_steps: 2
  save_freq: 20
  test_freq: 5
  val_before_train: true
  balance_batch: true
  offload: never
"""


# verl's docs/start/quickstart.rst, key for key: local model and data, trainer.n_gpus_per_node=2, CPU sizes
# (batch 8 for 256, mini-batch 4 for 64, responses of 8 tokens for 256). Added: the step count and the
# output folder.
PPO_QUICKSTART = """
    data.train_files={data}/train.parquet
    data.val_files={data}/test.parquet
    data.train_batch_size=8
    data.max_prompt_length=512
    data.max_response_length=8
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.optim.lr=1e-5
    critic.model.path={model}
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=['console']
    trainer.val_before_train=False
    trainer.default_hdfs_dir=null
    trainer.n_gpus_per_node=2
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=15
    trainer.total_training_steps=2
    trainer.default_local_dir={out}
"""


@prepare
def _inputs(base: Path) -> None:
    """verl's GSM8K parquet layout, made by spmdrl.builtin.gsm8k from GSM8K-style JSONL rows, the tiny
    model's folder, and the arithmetic task's rows as parquet files (DAPO's dynamic sampling needs groups
    whose rewards differ, which the warm start gives on them and a random model on GSM8K does not)."""
    from spmdrl.builtin.models import build_model
    from spmdrl.builtin.tasks import generate_arith, write_parquet

    (base / "verl").mkdir()
    gsm8k_parquet(base / "verl")
    build_model(base / "verl" / "tiny", "tiny", seed=0)
    write_parquet(generate_arith("train", 64, seed=0), base / "verl" / "arith_train.parquet")
    write_parquet(generate_arith("test", 8, seed=1), base / "verl" / "arith_test.parquet")


PATHS = dict(data="{base}/verl/data", model="{base}/verl/tiny")
declare("verl/grpo", [*shlex.split(VERL_COMMAND.format(**PATHS, out="{base}/verl/grpo")),
                      "--trainer.progress_bar", "false"], env={"WANDB_MODE": "offline"})
declare("verl/ppo", [*shlex.split(PPO_QUICKSTART.format(**PATHS, out="{base}/verl/ppo")),
                     "--trainer.progress_bar", "false"])
declare("verl/one_step_off", [*shlex.split(ONE_STEP_OFF_POLICY.format(**PATHS, out="{base}/verl/one_step_off",
                                                                      engine="")),
                              "--trainer.progress_bar", "false"])

declare("verl/dapo_one_step_off", [*shlex.split(DAPO_ONE_STEP_OFF_POLICY.format(
    **PATHS, out="{base}/verl/dapo_one_step_off", engine="")), "--trainer.progress_bar", "false"])
declare("verl/dapo_32b", [*shlex.split(DAPO_QWEN25_32B.format(
    data="{base}/verl/arith_train.parquet", val="{base}/verl/arith_test.parquet", model="builtin:tiny-arith",
    out="{base}/verl/dapo_32b")), "--trainer.progress_bar", "false"], env={"WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def verl_run(shared) -> dict:
    paths = {k: shared.path(v.replace("{base}/", "")) for k, v in PATHS.items()}
    return dict(paths, out=shared.path("verl/grpo"), stderr=shared.stderr("verl/grpo"),
                rows=shared.rows("verl/grpo"))


def test_ppo_quickstart_takes_its_steps(shared):
    """verl's first command: PPO with a critic, several mini-batches and verl's defaults (no rollout
    log-probs, so the old log-probs come from the actor alone)."""
    out, rows = shared.path("verl/ppo"), shared.rows("verl/ppo")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/ppo_kl"} <= set(r)
        assert r["timing/old_logp"] > 0 and "actor/reward_kl_penalty" not in r  # verl: no KL in the reward
        assert not [k for k in r if k.startswith(("rollout_corr/", "training/rollout_"))]
    assert any(k.startswith("val-core/openai/gsm8k/") for k in rows[-1])  # test_freq 10: at the last step
    assert (out / "checkpoints" / "global_step_2" / "manifest.json").is_file()  # save_freq 10: the last step
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["algorithm"]["adv_estimator"] == "gae"
    assert resolved["rollout"]["calculate_log_probs"] is False
    # verl's links: the critic's mini-batch and epochs follow the actor's.
    assert resolved["critic"]["ppo_mini_batch_size"] == 4 and resolved["actor"]["ppo_mini_batch_size"] == 4


def test_resolved_config_equals_the_hand_written_spmdrl_config(verl_run, tmp_path):
    from spmdrl.config.parse import parse_config

    hand = tmp_path / "same_run.yaml"
    hand.write_text(SPMDRL_YAML.format(**{k: verl_run[k] for k in ("data", "model", "out")}))
    expected = asdict(parse_config(["--config", str(hand), "--trainer.progress_bar", "false"])[0])
    resolved = yaml.safe_load((verl_run["out"] / "config.yaml").read_text())
    assert resolved == yaml.safe_load(yaml.safe_dump(expected, sort_keys=False))
    assert [r["step"] for r in verl_run["rows"]] == [0, 1, 2]  # validation before training, then 2 steps
    info = [line for line in verl_run["stderr"].splitlines()
            if "verl keys accepted with no effect" in line]
    assert info == []  # every key of this command line has an effect (optimizer_offload: trainer.offload)


def _step_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}


def test_tensorboard_event_file_holds_each_steps_metrics(verl_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((verl_run["out"] / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    expected = _step_rows(verl_run["rows"])
    assert {"reward/mean", "actor/pg_loss", "timing/step"} <= set(expected[2])
    for step, metrics in expected.items():
        for key, value in metrics.items():
            got = {e.step: e.value for e in acc.Scalars(key)}
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-6, nan_ok=True), (key, step)


def _wandb_records(path: Path):
    """Records of a .wandb file (LevelDB log framing: 32 KiB blocks of [crc32, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def test_wandb_offline_run_holds_each_steps_metrics(verl_run):
    runs = list((verl_run["out"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history, config = {}, {}
    for record in _wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    expected = _step_rows(verl_run["rows"])
    assert sorted(history) == sorted(expected) == [0, 1, 2]
    for step, metrics in expected.items():
        for key, value in metrics.items():
            assert history[step][key] == pytest.approx(value, rel=1e-9, nan_ok=True), (key, step)
    config = {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in config.items()}
    assert config["actor"]["lr"] == 1e-6 and config["algorithm"]["adv_estimator"] == "grpo"


def test_one_step_off_policy_recipe_runs_split(tmp_path, shared, monkeypatch, capsys):
    """verl's recipe as written (rollout.name=vllm) where vLLM is not installed: refused by name before any
    work (tests/vllm_engine/test_vllm_loop.py runs vLLM split where it is); with the native engine it runs."""
    from spmdrl.train import main

    paths = {k: shared.path(v.replace("{base}/", "")) for k, v in PATHS.items()}
    paths["out"] = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stopped:  # refused before any process group or model
        main(shlex.split(ONE_STEP_OFF_POLICY.format(**paths, engine="actor_rollout_ref.rollout.name=vllm")))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "rollout.engine is 'vllm' but" in err
    assert not paths["out"].exists()
    monkeypatch.delenv("WORLD_SIZE")

    err, rows = shared.stderr("verl/one_step_off"), shared.rows("verl/one_step_off")
    assert "verl keys accepted with no effect here: actor_rollout_ref.rollout.load_format" in err
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then 2 steps
    assert [r["async/staleness"] for r in rows[1:]] == [0.0, 1.0]
    # verl's default leaves the rollout's log-probs out: the actor's own are the old ones, as in its recipe.
    assert not [k for k in rows[2] if k.startswith("training/rollout_")]
    assert any(k.startswith("val-core/openai/gsm8k/") for k in rows[0]) and any(
        k.startswith("val-core/openai/gsm8k/") for k in rows[2])
    resolved = yaml.safe_load(shared.path("verl/one_step_off/config.yaml").read_text())
    assert resolved["rollout"]["placement"] == "split" and resolved["rollout"]["calculate_log_probs"] is False


def test_dapo_one_step_off_policy_recipe_runs_as_written(shared):
    """verl's DAPO recipe (its dapo reward manager with the overlong buffer as reward_kwargs, max_resp_len,
    the max_position_embeddings override) runs split for its 2 steps; every key took effect."""
    err, rows = shared.stderr("verl/dapo_one_step_off"), shared.rows("verl/dapo_one_step_off")
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then 2 steps
    assert "reward/overlong/mean" in rows[1] and "reward/overlong/ratio" in rows[1]
    resolved = yaml.safe_load(shared.path("verl/dapo_one_step_off/config.yaml").read_text())
    assert resolved["rollout"]["placement"] == "split"
    assert resolved["model"]["max_position_embeddings"] == 32768
    assert resolved["reward"]["overlong_buffer"] == {"enable": True, "len": 4, "penalty_factor": 1.0,
                                                     "max_resp_len": 16}
    assert resolved["actor"]["clip_ratio_high"] == 0.28 and resolved["actor"]["loss_agg_mode"] == "token-mean"
    assert "has no spmdrl equivalent" not in err


def test_dapo_32b_recipe_with_sequence_parallel_runs_as_written(shared):
    """verl's recipe/dapo/run_dapo_qwen2.5_32b.sh (tests/verl_recipes.py): Ulysses over both ranks
    (sp_size), token budgets, parameter and optimizer offload, and dynamic sampling drawing generation
    batches of data.gen_batch_size prompts, for its 2 steps after a validation."""
    err, rows = shared.stderr("verl/dapo_32b"), shared.rows("verl/dapo_32b")
    assert [r["step"] for r in rows] == [0, 1, 2]
    resolved = yaml.safe_load(shared.path("verl/dapo_32b/config.yaml").read_text())
    assert resolved["parallel"]["sp"] == 2 and resolved["data"]["gen_batch_size"] == 12
    assert resolved["actor"]["use_dynamic_bsz"] and resolved["actor"]["cpu_offload"]
    for r in rows[1:]:
        # Each round draws 12 prompts, every one kept or dropped; the step trains the first 4 kept groups.
        rounds = r["dapo/num_gen_batches"]
        assert r["dapo/kept_groups"] + r["dapo/dropped_groups"] == 12 * rounds and r["dapo/kept_groups"] >= 4
        assert r["batch/responses"] == 4 * 4
        assert "reward/overlong/mean" in r and math.isfinite(r["actor/grad_norm"])
    assert "has no spmdrl equivalent" not in err
