"""verl's key=value words and YAML files mapped onto spmdrl's config (spmdrl.verl.compat)."""

import shlex
from dataclasses import asdict

import pytest

from spmdrl.config import Config
from spmdrl.config.parse import parse_config
from spmdrl.train import main
from spmdrl.verl import compat as verl_compat
from spmdrl.verl.args import parse_value, rewrite_argv
from spmdrl.verl.docs import DOCS, QUICKSTART_SPMDRL_KEYS, QUICKSTART_VERL, render_docs
from spmdrl.verl.rules import spmdrl_keys


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_every_target_is_a_spmdrl_key_and_every_default_has_a_row():
    keys = spmdrl_keys()
    for rule in verl_compat.TABLE:
        for target in filter(None, rule.spmdrl.split(", ")):
            assert target in keys, f"{rule.verl} maps to {target}, which spmdrl's Config does not have"
    for key in [*verl_compat.VERL_DEFAULTS, *verl_compat.FOLLOWS, *verl_compat.FOLLOWS.values()]:
        assert verl_compat.rule_for(key) is not None and not verl_compat.rule_for(key).ignored, key
    verl_keys = [r.verl for r in verl_compat.TABLE]
    assert len(verl_keys) == len(set(verl_keys)), "a verl key has two rows"


def test_docs_file_is_what_the_generator_writes():
    assert DOCS.read_text() == render_docs(), "run: python -m spmdrl.verl.docs --write-docs"


@pytest.mark.parametrize("text,value", [
    ("1e-6", 1e-6), ("256", 256), ("-1", -1), ("0.5", 0.5), ("True", True), ("false", False), ("null", None),
    ("['console','wandb']", ["console", "wandb"]), ("[console]", ["console"]), ("'error'", "error"),
    ("vllm", "vllm"), ("/data/x.parquet", "/data/x.parquet"), ("[1e-3, 2]", [1e-3, 2]),
])
def test_hydra_values(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def _words(command: str) -> list[str]:
    """The arguments after ``-m <module>`` of a documented command line, with $HOME spelled out."""
    words = shlex.split(command.replace("\\\n", " ").replace("$HOME", "/home/u"))
    return words[words.index("-m") + 2:]


def test_docs_quickstart_sides_resolve_to_the_same_config():
    verl_side = _words(QUICKSTART_VERL) + ["actor_rollout_ref.rollout.name=vllm"]
    verl_side = [w.replace("Qwen/", "/home/u/models/") for w in verl_side]
    spmdrl_side = _words(QUICKSTART_SPMDRL_KEYS)
    assert asdict(parse_config(verl_side)[0]) == asdict(parse_config(spmdrl_side)[0])


def test_mapping_conversions_and_verl_defaults():
    cfg, _ = parse_config([
        "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.logger=['console','wandb']",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "algorithm.kl_ctrl.kl_coef=0.002", "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4",
        "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.top_k=0",
        "actor_rollout_ref.rollout.multi_turn.format=chatml", "reward_model.model.path=/rm",
        "actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "data.filter_overlong_prompts=True", "data.truncation=error", "trainer.resume_mode=disable",
        "custom_reward_function.path=my.py", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.train_files=[a.parquet,b.parquet]", "+trainer.total_training_steps=3",
        "actor_rollout_ref.nccl_timeout=1200",
    ])
    assert cfg.actor.lr == 1e-6 and cfg.trainer.logger == ["console", "jsonl", "wandb"]
    assert (cfg.rollout.engine == "vllm" and cfg.parallel.rollout_tp == 2
            and cfg.algorithm.kl_ctrl.kl_coef == 0.002)
    assert cfg.actor.strategy == "fsdp2" and (cfg.parallel.tp, cfg.parallel.pp) == (2, 4)
    assert cfg.rollout.val_kwargs.n == 4 and cfg.rollout.val_kwargs.top_k == -1
    assert cfg.rollout.multi_turn.format == "hermes" and cfg.reward_model.model.path == "/rm"
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.3, 0.28)
    assert cfg.data.truncation == "filter" and cfg.trainer.resume == "off"
    assert cfg.reward.function == "my.py:compute_score"
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and cfg.trainer.total_steps == 3
    assert cfg.trainer.hang_timeout_s == 1200  # verl's collective timeout is the hang watchdog's limit
    # verl's defaults where spmdrl's differ (a verl command line without an estimator is PPO), and
    # verl's interpolation critic.ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}.
    assert cfg.algorithm.adv_estimator == "gae" and cfg.rollout.n == 1 and cfg.data.train_batch_size == 1024
    assert cfg.critic.ppo_mini_batch_size == 8 and cfg.critic.lr == 1e-5
    # verl computes no rollout log-probs unless asked (spmdrl's own default keeps them)
    assert not cfg.rollout.calculate_log_probs and Config().rollout.calculate_log_probs
    asked = parse_config(["actor_rollout_ref.rollout.calculate_log_probs=True"])[0]
    assert asked.rollout.calculate_log_probs


def test_megatron_keys_of_actor_reference_and_critic():
    cfg, _ = parse_config([
        "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
        "critic.strategy=megatron",
        *[f"{p}.megatron.{k}={v}" for p in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
          for k, v in (("tensor_model_parallel_size", 2), ("pipeline_model_parallel_size", 2),
                       ("sequence_parallel", False), ("use_distributed_optimizer", False), ("seed", 42))],
        "reward_model.strategy=fsdp",  # the reward model is off: its strategy changes nothing
    ])
    assert cfg.actor.strategy == "megatron" and (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)


@pytest.mark.parametrize("name", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                                  "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"])
def test_ulysses_sizes_of_every_model_map_to_parallel_sp(name, monkeypatch):
    """Both names of the actor's key set parallel.sp; the reference's, critic's and reward model's may repeat
    it; verl's fsdp_size counts the SP ranks of a shard group."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg, _ = parse_config([
        f"{name}=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2",
        "critic.ulysses_sequence_parallel_size=2", "reward_model.ulysses_sequence_parallel_size=1",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=4", "trainer.n_gpus_per_node=8",
    ])
    assert (cfg.parallel.sp, cfg.parallel.dp_shard, cfg.parallel.dp_replicate) == (2, 2, 2)


def test_the_dapo_32b_scripts_older_keys():
    """recipe/dapo/run_dapo_qwen2.5_32b.sh's keys beside its sp_size: the token-level loss switch, the
    overlong buffer under custom_reward_function, dropout overrides of 0 and parameter offload."""
    cfg, _ = parse_config([
        "actor_rollout_ref.actor.use_token_level_loss=True",
        "custom_reward_function.overlong_buffer.enable=True",
        "custom_reward_function.overlong_buffer.len=4096",
        "custom_reward_function.overlong_buffer.penalty_factor=1.0",
        "+actor_rollout_ref.model.override_config.attention_dropout=0.",
        "+actor_rollout_ref.model.override_config.embd_pdrop=0.",
        "+actor_rollout_ref.model.override_config.resid_pdrop=0.",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    ])
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.actor.cpu_offload
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len) == (True, 4096)
    seq = parse_config(["actor_rollout_ref.actor.use_token_level_loss=False"])[0]
    assert seq.actor.loss_agg_mode == "seq-mean-token-mean"


def test_verl_null_keeps_spmdrl_default_unless_spmdrl_takes_null():
    cfg, _ = parse_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "data.val_files=null",
                           "trainer.total_training_steps=null",
                           "actor_rollout_ref.rollout.max_model_len=null"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 16  # spmdrl's default: this setting cannot be null
    assert (cfg.data.val_files is None and cfg.trainer.total_steps is None
            and cfg.rollout.max_model_len is None)


def test_precedence(tmp_path):
    spmdrl_yaml = tmp_path / "s.yaml"
    spmdrl_yaml.write_text("actor:\n  lr: 0.1\n  weight_decay: 0.1\n  entropy_coeff: 0.1\n"
                           "  kl_loss_coef: 0.1\n")
    verl_yaml = tmp_path / "v.yaml"
    verl_yaml.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 0.2\n      weight_decay: 0.2\n"
                         "    entropy_coeff: 0.2\n")
    cfg, _ = parse_config(["--actor.lr", "0.4", "actor_rollout_ref.actor.optim.lr=0.3",
                           "--verl-config", str(verl_yaml),
                           "actor_rollout_ref.actor.optim.weight_decay=0.3", "--config", str(spmdrl_yaml)])
    a = cfg.actor
    # --section.key > key=value > --verl-config > --config, whatever the order on the line.
    assert (a.lr, a.weight_decay, a.entropy_coeff, a.kl_loss_coef) == (0.4, 0.3, 0.2, 0.1)
    # With --config, verl's defaults do not replace the spmdrl file's base (spmdrl's defaults stand).
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 8


def test_verl_yaml_interpolations_and_hydra_defaults(tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("defaults:\n  - ppo_trainer\n  - _self_\n"
                 "data:\n  max_prompt_length: 100\n  image_key: null\n"
                 "actor_rollout_ref:\n  rollout:\n    max_model_len: ${data.max_prompt_length}\n"
                 "  actor:\n    optim:\n      lr: 3e-6\n")
    cfg, _ = parse_config(["--verl-config", str(f)])
    assert cfg.rollout.max_model_len == 100 and cfg.actor.lr == 3e-6


DUMP = """
data: {train_files: ~/gsm8k/train.parquet, val_files: null, max_prompt_length: 256, image_key: images,
       custom_cls: {path: null, name: null}, return_raw_chat: false, filter_overlong_prompts_workers: 1}
actor_rollout_ref:
  hybrid_engine: true
  model: {path: ~/models/qwen, override_config: {}, use_remove_padding: true, use_fused_loss: false}
  actor:
    ppo_mini_batch_size: 8
    ppo_micro_batch_size: null
    ppo_micro_batch_size_per_gpu: null
    ppo_max_token_len_per_gpu: 16384
    checkpoint: {contents: [model, optimizer, extra, hf_model]}
    optim: {lr: 1e-6, lr_warmup_steps: -1, lr_warmup_steps_ratio: 0., min_lr_ratio: null}
    fsdp_config: {wrap_policy: {min_num_params: 0}, param_offload: false, fsdp_size: -1}
  ref:
    log_prob_max_token_len_per_gpu: ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
  rollout:
    name: hf
    prompt_length: ${data.max_prompt_length}
    engine_kwargs: {swap_space: null}
critic:
  rollout_n: ${actor_rollout_ref.rollout.n}
  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
  model: {fsdp_config: {fsdp_size: -1}}
trainer:
  project_name: p
  experiment_name: e
  default_local_dir: ckpt/${trainer.project_name}/${trainer.experiment_name}
  nnodes: 1
  n_gpus_per_node: 1
  rollout_data_dir: null
ray_init: {num_cpus: null}
algorithm: {_target_: verl.trainer.config.AlgoConfig, adv_estimator: grpo}
"""


def test_a_verl_yaml_dump_with_nulls_interpolations_and_speed_knobs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    f = tmp_path / "dump.yaml"
    f.write_text(DUMP)
    cfg, _ = parse_config(["--verl-config", str(f)])
    assert cfg.data.train_files == "/home/u/gsm8k/train.parquet" and cfg.model.path == "/home/u/models/qwen"
    assert cfg.data.val_files is None and cfg.rollout.engine == "hf" and cfg.actor.lr == 1e-6
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 16 and cfg.critic.ppo_mini_batch_size == 8
    assert cfg.trainer.output_dir == "ckpt/p/e" and cfg.trainer.export_hf_on_save
    assert cfg.algorithm.adv_estimator == "grpo"
    info = capsys.readouterr().err
    assert info.count("\n") == 1 and "data.image_key (spmdrl trains on text prompts" in info
    assert "data.custom_cls.path, data.custom_cls.name" in info and "ray_init.num_cpus (Ray/placement" in info


def test_interpolation_cycle_is_one_sentence(capsys):
    code, err = run_main(["trainer.project_name=${trainer.experiment_name}",
                          "trainer.experiment_name=${trainer.project_name}"], capsys)
    assert code == 2 and "refers to itself through interpolations (a cycle)" in err


def test_plain_spmdrl_argv_is_untouched():
    argv = ["--config", "x.yaml", "--actor.lr", "1e-5", "--print_config"]
    assert rewrite_argv(argv) == (argv, {})


def test_ignored_keys_give_one_info_line(capsys):
    parse_config(["ray_init.num_cpus=8", "trainer.ray_wait_register_center_timeout=300",
                  "actor_rollout_ref.rollout.enable_chunked_prefill=True"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "spmdrl.train: info: verl keys accepted with no effect here:")
    assert "ray_init.num_cpus" in err and "enable_chunked_prefill" in err


BAD = [
    (["actor_rollout_ref.actor.use_fancy_thing=True"],
     "verl key actor_rollout_ref.actor.use_fancy_thing=True has no spmdrl equivalent yet"),
    (["trainer.n_gpus_per_node=8"],
     "trainer.n_gpus_per_node x trainer.nnodes = 8 x 1 do not match the 1 rank(s)"),
    (["actor_rollout_ref.rollout.mode=async"],
     "verl key actor_rollout_ref.rollout.mode='async' is not supported"),
    (["actor_rollout_ref.actor.optim.lr=fast"], "(set by verl key actor_rollout_ref.actor.optim.lr)"),
    (["data.truncation=middle"], "verl key data.truncation='middle' has no spmdrl equivalent; valid values:"),
    (["actor_rollout_ref.actor.strategy=deepspeed"],
     "actor.strategy is 'deepspeed'; valid values: fsdp2, megatron"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_mode=resume_path needs trainer.resume_from_path"),
    (["critic.strategy=megatron"],
     "critic.strategy='megatron' differs from actor_rollout_ref.actor.strategy='fsdp2'"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "critic.megatron.tensor_model_parallel_size=1"],
     "critic.megatron.tensor_model_parallel_size=1 differs from actor_rollout_ref.actor.megatron."
     "tensor_model_parallel_size=2"),
    (["actor_rollout_ref.actor.megatron.sequence_parallel=True"],
     "sequence_parallel=True is not supported: spmdrl accepts only False"),
    (["critic.megatron.use_distributed_optimizer=True"],
     "use_distributed_optimizer=True is not supported: spmdrl accepts only False"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=1"],
     "verl key critic.ulysses_sequence_parallel_size=1 differs from the actor's ulysses_sequence_parallel_"
     "size 2: spmdrl runs every model on one training mesh with parallel.sp"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
      "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4"],
     "differ; they name one setting"),
    (["actor_rollout_ref.actor.megatron.context_parallel_size=2"],
     "context parallelism needs Transformer Engine's attention"),
    (["+actor_rollout_ref.model.override_config.attention_dropout=0.1"],
     "attention_dropout=0.1 is not supported: spmdrl accepts only 0 or 0.0"),
    (["trainer.total_steps=3"],
     "trainer.total_steps=3 is a spmdrl key, not a verl key; write it as --trainer.total_steps"),
]


@pytest.mark.parametrize("argv,fragment", BAD, ids=[a[0] for a, _ in BAD])
def test_bad_verl_input_exits_2_with_one_sentence(argv, fragment, capsys):
    code, err = run_main(argv, capsys)
    assert code == 2 and fragment in err, err
    assert err.startswith("spmdrl.train: error: ") and err.count("\n") == 1


def test_the_dapo_reward_manager_and_its_overlong_buffer_in_both_forms():
    """verl's DAPO recipes: reward_manager=dapo with reward_kwargs.overlong_buffer_cfg and max_resp_len (the
    one-step-off-policy DAPO script), or the older reward_model.overlong_buffer keys."""
    cfg, _ = parse_config(["reward_model.reward_manager=dapo", "data.max_response_length=32",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                           "+reward_model.reward_kwargs.max_resp_len=24"])
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.max_resp_len) == (True, 8, 0.5, 24)
    cfg, _ = parse_config(["reward_model.reward_manager=dapo", "data.max_response_length=32",
                           "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4"])
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.max_resp_len) == (True, 4, None)


def test_several_bad_keys_are_named_in_one_sentence(capsys):
    """A recipe with several keys spmdrl cannot take learns of all of them from one run."""
    code, err = run_main(["actor_rollout_ref.actor.use_fancy_thing=True", "trainer.total_steps=3",
                          "actor_rollout_ref.rollout.mode=async", "reward_model.reward_manager=prime"],
                         capsys)
    assert code == 2 and err.startswith("spmdrl.train: error: 4 verl keys cannot run here: (1) verl key "
                                        "actor_rollout_ref.actor.use_fancy_thing=True has no spmdrl"), err
    assert err.count("\n") == 1
    for fragment in ("(2) trainer.total_steps=3 is a spmdrl key", "rollout.mode='async' is not supported",
                     "reward_model.reward_manager='prime'", "(4) "):
        assert fragment in err, (fragment, err)


def test_world_size_from_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, _ = parse_config(["trainer.n_gpus_per_node=2", "trainer.nnodes=1", "data.train_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4  # verl's deprecated global size / world size
    code, err = run_main(["trainer.n_gpus_per_node=1", "trainer.nnodes=1"], capsys)
    assert code == 2 and "= 1 x 1 do not match the 2 rank(s) torchrun started" in err


def test_command_line_interpolation_and_print_config_outside_torchrun():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(DOCS.parents[1])
    out = subprocess.run(
        [sys.executable, "-m", "spmdrl.train", "trainer.n_gpus_per_node=8",
         "actor_rollout_ref.actor.optim.lr=2e-6", "trainer.project_name=p",
         "trainer.default_local_dir=${trainer.project_name}", "--print_config"],
        capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "  lr: 2.0e-06\n" in out.stdout and "  output_dir: p\n" in out.stdout
    assert "adv_estimator: gae" in out.stdout  # verl's default for a verl command line


def test_packing_and_token_budget_keys_take_their_verl_meaning():
    cfg = parse_config(["actor_rollout_ref.model.use_remove_padding=True",
                        "critic.model.use_remove_padding=True", "reward_model.model.use_remove_padding=True",
                        "actor_rollout_ref.actor.use_dynamic_bsz=True",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
                        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2048",
                        "critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=8192",
                        "reward_model.use_dynamic_bsz=True",
                        "reward_model.forward_max_token_len_per_gpu=1024"])[0]
    assert cfg.model.use_remove_padding and cfg.critic.use_remove_padding
    assert cfg.reward_model.model.use_remove_padding
    assert (cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu) == (True, 4096)
    # verl's interpolations: the log-prob budgets follow the training ones unless given
    assert (cfg.actor.log_prob_use_dynamic_bsz, cfg.actor.log_prob_max_token_len_per_gpu) == (True, 4096)
    assert (cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu) == (True, 2048)
    assert (cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu) == (True, 8192)
    assert cfg.critic.forward_max_token_len_per_gpu == 8192
    assert (cfg.reward_model.use_dynamic_bsz, cfg.reward_model.forward_max_token_len_per_gpu) == (True, 1024)


def test_verl_links_do_not_override_what_a_config_file_sets(tmp_path):
    """A mixed command line: verl's linked defaults (FOLLOWS) fill only keys that neither the verl words nor
    the --config files give."""
    mine = tmp_path / "s.yaml"
    mine.write_text("critic:\n  ppo_mini_batch_size: 16\n  ppo_epochs: 3\n"
                    "  forward_max_token_len_per_gpu: 999\nactor:\n  log_prob_max_token_len_per_gpu: 777\n"
                    "ref:\n  log_prob_max_token_len_per_gpu: 555\n")
    for config in (str(mine), mine.read_text()):  # a file, or YAML text as jsonargparse also takes it
        cfg = parse_config(["--config", config, "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                            "actor_rollout_ref.actor.ppo_epochs=2",
                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                            "critic.ppo_max_token_len_per_gpu=8192"])[0]
        assert (cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size) == (4, 16)
        assert (cfg.actor.ppo_epochs, cfg.critic.ppo_epochs) == (2, 3)
        assert cfg.actor.log_prob_max_token_len_per_gpu == 777
        assert cfg.ref.log_prob_max_token_len_per_gpu == 555
        assert cfg.critic.forward_max_token_len_per_gpu == 999
    # verl's clip_ratio is the default of both sides: a side the file gives keeps its value.
    dapo = parse_config(["--config", "configs/dapo.yaml", "actor_rollout_ref.actor.clip_ratio=0.3"])[0]
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    # A key the file leaves out still follows, as in verl.
    cfg = parse_config(["--config", "configs/grpo.yaml", "actor_rollout_ref.actor.ppo_epochs=2"])[0]
    assert cfg.critic.ppo_epochs == 2


def test_vllm_runs_cuda_graphs_on_cuda_and_eager_on_cpu():
    """rollout.enforce_eager null (the default, as verl's false): CUDA graphs on a GPU, eager on CPU; verl's
    cudagraph_capture_sizes reaches vLLM's compilation config, and an explicit enforce_eager wins."""
    import torch

    from spmdrl.rollout.vllm import VLLMOptions, _graph_sizes

    cfg = parse_config(["actor_rollout_ref.rollout.cudagraph_capture_sizes=[8,1,4]"])[0]
    assert cfg.rollout.enforce_eager is None and cfg.rollout.cudagraph_capture_sizes == [8, 1, 4]
    cuda, cpu = (VLLMOptions.from_config(cfg, torch.device(d)) for d in ("cuda", "cpu"))
    assert (cuda.enforce_eager, cpu.enforce_eager) == (False, True)
    assert _graph_sizes(cuda) == {"compilation_config": {"cudagraph_capture_sizes": [1, 4, 8]}}
    assert _graph_sizes(cpu) == {}  # eager: nothing to capture
    eager = parse_config(["actor_rollout_ref.rollout.enforce_eager=True"])[0]
    assert VLLMOptions.from_config(eager, torch.device("cuda")).enforce_eager is True


def test_verl_one_step_off_policy_keys_make_a_split_placement(monkeypatch, capsys):
    """verl's one_step_off_policy recipe: no hybrid engine, trainer.* ranks train, rollout.* ranks generate,
    and torchrun's world holds both."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg, _ = parse_config(["actor_rollout_ref.hybrid_engine=False", "trainer.n_gpus_per_node=2",
                           "trainer.nnodes=1", "rollout.n_gpus_per_node=1", "rollout.nnodes=1"])
    r = cfg.rollout
    assert (r.placement, r.nnodes, r.n_gpus_per_node) == ("split", 1, 1)
    code, err = run_main(["actor_rollout_ref.hybrid_engine=False", "trainer.n_gpus_per_node=3",
                          "rollout.n_gpus_per_node=1"], capsys)
    assert code == 2 and "= 3 x 1 (+ 1 rollout ranks) do not match the 3 rank(s)" in err
