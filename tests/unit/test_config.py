"""Bad configs: each gives one clear sentence on stderr and exit code 2, before any distributed work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.config import output_dir
from spmdrl.config.parse import parse_config
from spmdrl.train import main

REPO = Path(__file__).resolve().parents[2]
GRPO = str(REPO / "configs" / "grpo.yaml")


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    return exc.value.code, err


RC = "--algorithm.rollout_correction."
BAD = [
    # (extra argv, fragment expected in the message)
    (["--actor.lr", "0"], "actor.lr is 0.0; the learning rate must be > 0"),
    (["--model.max_position_embeddings", "64"], "model.max_position_embeddings is 64, fewer than "
                                                "data.max_prompt_length + data.max_response_length"),
    (["--critic.lr=-1e-3"], "critic.lr is -0.001"),
    (["--actor.clip_ratio_low", "0"], "actor.clip_ratio_low is 0.0; clip ratios must be > 0"),
    (["--actor.clip_ratio_c", "0.5"], "actor.clip_ratio_c is 0.5; the dual-clip bound must be > 1"),
    (["--rollout.temperature", "-0.1"], "rollout.temperature is -0.1"),
    (["--rollout.top_p", "1.5"], "rollout.top_p is 1.5; it must be in (0, 1]"),
    (["--rollout.top_p", "0"], "rollout.top_p is 0.0"),
    (["--rollout.n", "1"], "needs rollout.n >= 2"),
    ([f"{RC}rollout_rs", "token"], "rollout_rs is token but rollout_rs_threshold is null"),
    ([f"{RC}rollout_is", "tokens"], "algorithm.rollout_correction.rollout_is"),
    ([f"{RC}rollout_is_threshold", "0"], "rollout_is_threshold is 0.0; it must be > 0"),
    ([f"{RC}rollout_rs", "token", f"{RC}rollout_rs_threshold", "2", f"{RC}rollout_rs_threshold_lower", "3"],
     "rollout_rs_threshold_lower is 3.0; it must be > 0 and below rollout_rs_threshold"),
    ([f"{RC}bypass_mode", "true", f"{RC}rollout_is", "token"],
     "bypass_mode takes the rollout log-probs as the old ones"),
    ([f"{RC}rollout_is", "token", "--rollout.top_p", "0.9"], "are of a truncated distribution"),
    ([f"{RC}bypass_mode", "true", "--rollout.calculate_log_probs", "false"],
     "uses the rollout engine's log-probs, but rollout.calculate_log_probs is false"),
    ([f"{RC}rollout_token_veto_threshold", "2"], "it must be in (0, 1)"),
    (["--actor.ppo_mini_batch_size", "32"], "is larger than data.train_batch_size"),
    (["--data.train_batch_size", "12", "--actor.ppo_mini_batch_size", "8"],
     "not a multiple of actor.ppo_mini_batch_size"),
    (["--model.path", "/nonexistent/model"], "model.path '/nonexistent/model' is not a folder"),
    (["--data.train_files", "/nonexistent/train.parquet"],
     "data.train_files names '/nonexistent/train.parquet'"),
    (["--algorithm.adv_estimator", "magic"], "algorithm.adv_estimator is 'magic'; valid values:"),
    (["--actor.policy_loss", "nope"], "actor.policy_loss is 'nope'; valid values:"),
    (["--rollout.engine", "trt"], "rollout.engine is 'trt'; valid values: hf, native"),
    # Backends that are not part of this version are refused before any work, not after start-up.
    (["--rollout.engine", "tensorrt"],
     "rollout.engine is 'tensorrt'; valid values: hf, native, sglang, vllm"),
    (["--actor.strategy", "deepspeed"], "actor.strategy is 'deepspeed'; valid values: fsdp2, megatron"),
    (["--actor.param_dtype", "fp8"], "actor.param_dtype"),
    (["--actor.kl_loss_type", "k9"], "actor.kl_loss_type is 'k9'"),
    (["--actor.loss_agg_mode", "mean"], "actor.loss_agg_mode is 'mean'"),
    (["--actor.lr", "fast"], 'config key "actor.lr": Expected a float. Got value: fast'),
    (["--actor.bogus", "1"], "unrecognized arguments: --actor.bogus"),
    (["--rollout.sleep_level", "3"], "rollout.sleep_level"),
    (["--trainer.rollout_data_dir", "/tmp/gen"], "rollout_data_dir is '/tmp/gen'; it must be a folder"),
    (["--trainer.rollout_data_dir", "checkpoints/x"], "not one of the run's own"),
    (["--trainer.logger", "[console,mlflow]"], "trainer.logger has 'mlflow'"),
    (["--parallel.tp", "3"], "not divisible by parallel.dp_replicate x tp x pp x sp = 3"),
    (["--parallel.rollout_tp", "2", "--parallel.tp", "1"], "does not divide the world size 1"),
    (["--model.fused_kernels", "fast"], "model.fused_kernels"),
    (["--rollout.native_kernels", "on", "--rollout.dtype", "float16"], "rollout.native_kernels is 'on' with"),
    (["--rollout.native_kernels", "fast"], "rollout.native_kernels"),
    (["--reward.function", "rewards.txt"], "reward.function is 'rewards.txt'"),
    (["--reward.function", "/nonexistent/r.py:score"], "names the file '/nonexistent/r.py'"),
    (["--trainer.resume", "/nonexistent/ckpt"], "trainer.resume is '/nonexistent/ckpt'"),
    (["--trainer.save_freq", "0"], "trainer.save_freq is 0"),
    (["--trainer.experiment_name", "../../x"],
     "trainer.experiment_name is '../../x'; it must be one folder name"),
    (["--trainer.project_name", ".."], "trainer.project_name is '..'; it must be one folder name"),
    (["--trainer.output_dir", "out/{experiment}"],
     "trainer.output_dir is 'out/{experiment}', which the run cannot fill in (KeyError: 'experiment'); "
     "it may use {project_name}"),
    (["--trainer.plot_freq", "0"], "trainer.plot_freq is 0"),
    (["--trainer.hang_timeout_s", "-5"],
     "trainer.hang_timeout_s is -5.0; it must be a number of seconds > 0"),
    (["--trainer.plot_freq", "2", "--trainer.logger", "[console]"],
     "trainer.plot_freq is 2 but trainer.logger"),
    (["--trainer.val_only", "true", "--data.val_files", "null"],
     "trainer.val_only is true but data.val_files"),
    (["--reward_model.enable", "true"], "reward_model.model.path is null"),
    (["--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm",
      "--reward_model.rm_weight", "0"], "reward_model.rm_weight and reward_model.rule_weight are both 0"),
    (["--reward_model.enable", "true", "--reward_model.model.path", "/nonexistent/rm"],
     "reward_model.model.path '/nonexistent/rm'"),
    (["--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm",
      "--reward_model.micro_batch_size_per_gpu", "0"], "reward_model.micro_batch_size_per_gpu is 0"),
    (["--actor.use_dynamic_bsz", "true", "--actor.ppo_max_token_len_per_gpu", "0"],
     "actor.ppo_max_token_len_per_gpu is 0 with actor.use_dynamic_bsz: true; a micro-batch token budget"),
    (["--critic.use_dynamic_bsz", "true", "--critic.forward_max_token_len_per_gpu", "-1"],
     "critic.forward_max_token_len_per_gpu is -1 with critic.use_dynamic_bsz: true"),
    (["--ref.log_prob_use_dynamic_bsz", "true", "--ref.log_prob_max_token_len_per_gpu", "0"],
     "ref.log_prob_max_token_len_per_gpu is 0"),
    (["--model.use_remove_padding", "true", "--model.attn_implementation", "flash_attention_2"],
     "model.use_remove_padding is true with model.attn_implementation 'flash_attention_2'"),
]


SPLIT = ["--rollout.placement", "split", "--rollout.n_gpus_per_node", "1"]
# Split placement on 2 ranks: its keys, and what it refuses before any work.
BAD_SPLIT = [
    (["--rollout.placement", "split"], "rollout.nnodes x rollout.n_gpus_per_node is 1 x None"),
    ([*SPLIT, "--rollout.n_gpus_per_node", "2"], "leaves no rank of the 2 to train"),
    ([*SPLIT, "--rollout.max_staleness", "-1"], "rollout.max_staleness is -1; it must be >= 0"),
]


@pytest.mark.parametrize("extra,fragment", BAD_SPLIT, ids=[" ".join(a) for a, _ in BAD_SPLIT])
def test_bad_split_placement_exits_2_with_one_sentence(extra, fragment, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = run_main(["--config", GRPO, "--data.train_batch_size", "4", "--actor.ppo_mini_batch_size",
                          "4", *extra], capsys)
    assert code == 2 and fragment in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_exits_2_with_one_sentence(extra, fragment, capsys):
    code, err = run_main(["--config", GRPO, *extra], capsys)
    assert code == 2
    assert fragment in err, err
    assert err.startswith("spmdrl.train: error: ")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_keys_in_yaml_and_broken_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: 1e-5\n  bogus: 3\n")
    code, err = run_main(["--config", str(bad)], capsys)
    assert code == 2 and "does not accept option 'bogus'" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor: [\n")
    code, err = run_main(["--config", str(broken)], capsys)
    assert code == 2 and "Problems parsing config" in err
    code, err = run_main(["--config", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "does not exist" in err


def test_world_size_consistency(monkeypatch, capsys):
    # 16 prompts cannot be split over 3 data-parallel ranks with groups kept whole.
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, err = run_main(["--config", GRPO], capsys)
    assert code == 2 and "make data.train_batch_size a multiple of 3" in err


PPO = str(REPO / "configs" / "ppo.yaml")


@pytest.mark.parametrize("extra,fragment", [
    # A critic mini-batch of 1 prompt on 2 ranks would be 0 rows per rank (range(0, n, 0) at step 1).
    (["--critic.ppo_mini_batch_size", "1"], "critic.ppo_mini_batch_size x rollout.n = 1 x 2 does not split "
                                            "evenly over 2 ranks"),
    (["--critic.ppo_mini_batch_size", "12"], "data.train_batch_size (32) is not a multiple of "
                                             "critic.ppo_mini_batch_size (12)"),
    (["--critic.ppo_mini_batch_size", "64"], "critic.ppo_mini_batch_size (64) is larger than"),
])
def test_the_critics_mini_batch_is_checked_as_the_actors(extra, fragment):
    from spmdrl.config.checks import validate_config
    from spmdrl.errors import ConfigError

    cfg, _ = parse_config(["--config", PPO, *extra])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 2)
    assert fragment in str(err.value)
    # Without a critic the key is not used, so nothing is refused for it.
    validate_config(parse_config(["--config", GRPO, *extra])[0], 2)


def test_backends_check_their_own_options(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = run_main(["--config", GRPO, "--parallel.rollout_tp", "2"], capsys)
    assert code == 2 and ("rollout_tp is 2 but the native and hf rollout engines run one engine per rank"
                          in err)
    code, err = run_main(["--config", GRPO, "--parallel.pp", "2", "--parallel.dp_shard", "1"], capsys)
    assert code == 2 and "parallel.pp is 2 but actor.strategy 'fsdp2' has no pipeline schedule" in err
    code, err = run_main(["--config", GRPO, "--model.fused_kernels", "on", "--parallel.tp", "2"], capsys)
    assert code == 2 and "model.fused_kernels is 'on' with parallel.tp=2" in err


@pytest.mark.parametrize("extra, world, fragment", [
    # 4 attention heads (2 key/value heads): sp 3 cannot split them
    (["--parallel.sp", "3"], "3", "parallel.sp is 3, which does not divide the 4 attention heads of "
     "model.path 'builtin:tiny-arith' (2 key/value heads); choose an sp that divides 4"),
    (["--parallel.sp", "2", "--parallel.tp", "2"], "4", "sequence and tensor parallelism do not combine yet"),
    (["--parallel.sp", "2", "--actor.strategy", "megatron"], "2",
     "megatron-core's context parallelism needs Transformer Engine's attention"),
])
def test_sequence_parallel_refusals(extra, world, fragment, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world)
    code, err = run_main(["--config", GRPO, "--data.train_batch_size", "12",
                          "--actor.ppo_mini_batch_size", "12", *extra], capsys)
    assert code == 2 and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, fragment", [
    (["--reward_model.enable", "true", "--reward_model.model.path", "builtin:tiny-rm"],
     "reward_model.enable is true but actor.strategy 'megatron' builds no reward model"),
    (["--actor.param_dtype", "float16"], "computes in float32 or bfloat16"),
    (["--parallel.pp", "3"], "parallel.pp=3 does not divide the model's num_hidden_layers (4)"),
    (["--actor.cpu_offload", "true"], "actor.cpu_offload / ref.offload is true"),
    (["--actor.use_dynamic_bsz", "true"], "actor.use_dynamic_bsz is true but actor.strategy 'megatron'"),
])
def test_megatron_checks_its_options(extra, fragment, monkeypatch, capsys):
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("WORLD_SIZE", "3" if "3" in extra else "2")
    code, err = run_main(["--config", GRPO, "--actor.strategy", "megatron", "--data.train_batch_size", "6",
                          "--actor.ppo_mini_batch_size", "6", *extra], capsys)
    assert code == 2 and fragment in err, err


def test_overrides_and_output_dir():
    cfg, debug = parse_config(["--config", GRPO, "--actor.lr", "2e-5", "--trainer.experiment_name", "x",
                               "--debug", "true"])
    assert cfg.actor.lr == 2e-5 and debug
    assert str(output_dir(cfg)) == "outputs/spmdrl/x"
    assert cfg.data.train_files == "builtin:arith"


def test_a_renamed_key_keeps_its_old_name(tmp_path):
    """trainer.colocate is trainer.sleep_rollout now: the old name still works on the command line (both
    forms) and in a --config file, and the new one wins where both are given in order."""
    old = tmp_path / "old.yaml"
    old.write_text("trainer: {colocate: false, total_steps: 3}\n")
    for argv in (["--config", GRPO, "--trainer.colocate", "false"],
                 ["--config", GRPO, "--trainer.colocate=false"],
                 ["--config", GRPO, "--config", str(old)], [f"--config={old}"]):
        cfg, _ = parse_config(argv)
        assert cfg.trainer.sleep_rollout is False, argv
    cfg, _ = parse_config(["--config", str(old)])
    assert cfg.trainer.total_steps == 3  # the rest of the file still applies
    assert parse_config(["--config", GRPO, "--trainer.colocate", "false", "--trainer.sleep_rollout", "true"]
                        )[0].trainer.sleep_rollout is True
    both = tmp_path / "both.yaml"
    both.write_text("trainer: {colocate: false, sleep_rollout: true}\n")
    assert parse_config(["--config", str(both)])[0].trainer.sleep_rollout is True


def test_debug_shows_traceback():
    from spmdrl.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--config", GRPO, "--actor.lr", "0", "--debug", "true"])


def test_cli_subprocess_help_and_error():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "spmdrl.train", "--help"], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0
    assert "--actor.clip_ratio_high" in out.stdout and "Peak learning rate of AdamW" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "spmdrl.train", "--config", GRPO, "--rollout.top_p", "2"],
        capture_output=True, text=True, env=env,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "spmdrl.train: error: rollout.top_p is 2.0; it must be in (0, 1]"
    out = subprocess.run(
        [sys.executable, "-m", "spmdrl.train", "--config", GRPO, "--print_config"],
        capture_output=True, text=True, env=env,
    )
    assert out.returncode == 0 and "adv_estimator: grpo" in out.stdout


def test_vllm_engine_needs_vllm_and_a_dividing_tp(monkeypatch, capsys):
    from spmdrl.rollout.vllm import vllm_available

    monkeypatch.setenv("WORLD_SIZE", "3")
    code, err = run_main(["--config", GRPO, "--rollout.engine", "vllm", "--parallel.rollout_tp", "2"], capsys)
    assert code == 2 and "parallel.rollout_tp is 2, which does not divide the world size 3" in err
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = run_main(["--config", GRPO, "--rollout.engine", "vllm", "--parallel.rollout_tp", "2",
                          "--data.train_batch_size", "6", "--actor.ppo_mini_batch_size", "2"], capsys)
    assert code == 2 and "make data.train_batch_size a multiple of 4" in err, err
    if vllm_available() is not None:  # tests/vllm_engine cover the installed case
        monkeypatch.setenv("WORLD_SIZE", "2")
        code, err = run_main(["--config", GRPO, "--rollout.engine", "vllm"], capsys)
        assert code == 2 and ("rollout.engine is 'vllm' but vLLM is not installed in this Python environment"
                              in err)
        assert err.count("\n") == 1


def test_sglang_engine_needs_sglang(monkeypatch, capsys):
    from spmdrl.rollout.sglang import sglang_available

    if sglang_available() is not None:  # tests/sglang_engine cover the installed case
        monkeypatch.setenv("WORLD_SIZE", "2")
        code, err = run_main(["--config", GRPO, "--rollout.engine", "sglang"], capsys)
        assert code == 2 and ("rollout.engine is 'sglang' but SGLang is not installed in this Python "
                              "environment; make its environment with `bash .ci/sglang-venv`" in err), err
        assert err.count("\n") == 1


def test_a_position_override_is_refused_where_rope_reads_it(tiny_model_dir, tmp_path, capsys):
    """model.max_position_embeddings (verl's override_config) raises a limit; on a model whose RoPE
    frequencies depend on it (dynamic NTK scaling) it would change the model, so it is refused by name."""
    import json
    import shutil

    folder = tmp_path / "dynamic"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"  # transformers 5 / 4
    config[key] = {**(config.get(key) or {}), "rope_type": "dynamic", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    code, err = run_main(["--config", GRPO, "--model.path", str(folder), "--model.max_position_embeddings",
                          "32768", "--trainer.plan_only", "true"], capsys)
    assert code == 2 and "uses 'dynamic' RoPE scaling, whose frequencies depend on it" in err
    # A model with plain RoPE takes it: the plan is printed and nothing refused.
    main(["--config", GRPO, "--model.path", str(tiny_model_dir), "--model.max_position_embeddings", "32768",
          "--trainer.plan_only", "true"])
    assert "error" not in capsys.readouterr().err


def test_the_plan_of_qwen3_30b_a3b_counts_every_expert_and_the_routing_record(capsys):
    """``--trainer.plan_only`` on Qwen3-30B-A3B's shape: float32 master weights of all 30.5B parameters
    (every expert), and the routing record the native engine keeps for routing replay: 64 prompts x 8
    responses of 64 + 8,192 tokens, 48 layers x 8 experts, one byte each."""
    main(["--config", "configs/grpo_moe.yaml", "--model.path", "builtin:qwen3-30b-a3b-shape",
          "--trainer.plan_only", "true", "--data.train_batch_size", "64",
          "--data.max_response_length", "8192"])
    import re

    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split()[-1]
            for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert float(rows["actor weights"]) * 1024**3 == pytest.approx(30_532_122_624 * 4, rel=1e-3)
    assert float(rows["routing record"]) * 1024**3 == pytest.approx(64 * 8 * (64 + 8192) * 48 * 8, rel=1e-3)
