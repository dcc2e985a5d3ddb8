"""Realistic bad input of each class stops before start-up (exit 2, one sentence naming the key, file or row
and what is allowed): optimizer, KL and DAPO values, the device, builtin: names, parquet rows, data sources
without a scorer, missing ground truths, model folders (sizes, rope, weights, shapes, vocab, positions),
verl-style async tool classes and a tokenizer without a chat template. Every bad input is built here."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spmdrl.config.model_folder import check_vocab, validate_model_folder
from spmdrl.train import main

REPO = Path(__file__).resolve().parents[2]
GRPO = str(REPO / "configs" / "grpo.yaml")
GRPO_TOOLS = str(REPO / "configs" / "grpo_tools.yaml")
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


def assert_one_sentence(code: int, err: str, fragment: str) -> None:
    assert code == 2, err
    assert fragment in err, err
    assert err.startswith("spmdrl.train: error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture(autouse=True)
def _world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


VALUES = [
    # optimizer and schedule
    (["--actor.lr", "5"], "actor.lr is 5.0; a learning rate above 1 makes AdamW diverge"),
    (["--actor.betas", "[0.9, 1.0]"], "actor.betas is [0.9, 1.0]; AdamW needs two betas in [0, 1)"),
    (["--actor.betas", "[-0.1, 0.99]"], "actor.betas is [-0.1, 0.99]"),
    (["--actor.weight_decay", "-0.01"], "actor.weight_decay is -0.01; it must be >= 0"),
    (["--critic.weight_decay", "-1"], "critic.weight_decay is -1.0"),
    (["--actor.max_grad_norm", "-1"], "actor.max_grad_norm is -1.0; it must be > 0, or 0 to disable"),
    (["--actor.lr_warmup_steps", "-5"], "actor.lr_warmup_steps is -5; it must be >= 0"),
    (["--actor.lr_warmup_steps", "10", "--trainer.total_steps", "5"],
     "actor.lr_warmup_steps (10) is more than trainer.total_steps (5)"),
    (["--actor.min_lr_ratio", "1.5"], "actor.min_lr_ratio is 1.5; it must be in [0, 1]"),
    (["--reward.num_workers", "-1"], "reward.num_workers is -1; it must be >= 0"),
    (["--reward.timeout_s", "0"], "reward.timeout_s is 0.0; it must be > 0"),
    # KL controller and DAPO
    (["--actor.clip_ratio_low", "1.0", "--actor.clip_ratio_high", "1.0"], "actor.clip_ratio_low is 1.0"),
    (["--actor.clip_ratio_low", "0.28", "--actor.clip_ratio_high", "0.2"],
     "actor.clip_ratio_low (0.28) is above actor.clip_ratio_high (0.2)"),
    (["--actor.use_kl_loss", "true", "--actor.kl_loss_coef", "0"],
     "actor.use_kl_loss is true but actor.kl_loss_coef is 0"),
    (["--algorithm.use_kl_in_reward", "true", "--algorithm.kl_ctrl.kl_coef", "0"],
     "algorithm.use_kl_in_reward is true but algorithm.kl_ctrl.kl_coef is 0"),
    (["--algorithm.kl_ctrl.kl_coef", "-0.1"], "algorithm.kl_ctrl.kl_coef is -0.1; it must be >= 0"),
    (["--algorithm.kl_ctrl.type", "adaptive", "--algorithm.kl_ctrl.target_kl", "0"],
     "algorithm.kl_ctrl.target_kl is 0.0; the adaptive controller needs a target KL > 0"),
    (["--algorithm.kl_ctrl.type", "adaptive", "--algorithm.kl_ctrl.horizon", "0"],
     "algorithm.kl_ctrl.horizon is 0"),
    (["--algorithm.kl_ctrl.type", "pid"], "algorithm.kl_ctrl.type\": Expected one of 'fixed', 'adaptive'"),
    (["--algorithm.filter_groups.max_num_gen_batches", "-1"],
     "algorithm.filter_groups.max_num_gen_batches is -1; it must be >= 0"),
    (["--data.gen_batch_size", "48"], "data.gen_batch_size is 48 but data.train_batch_size is 16 and "
     "algorithm.filter_groups.enable is false"),
    (["--data.gen_batch_size", "0"], "data.gen_batch_size is 0; it must be an integer >= 1 or null"),
    (["--algorithm.filter_groups.enable", "true", "--rollout.n", "1", "--algorithm.adv_estimator",
      "reinforce_plus_plus"], "filter_groups needs rollout.n >= 2"),
    (["--reward.overlong_buffer.enable", "true", "--reward.overlong_buffer.len", "32"],
     "reward.overlong_buffer.len is 32; it must be in (0, data.max_response_length=16]"),
    (["--reward.overlong_buffer.enable", "true", "--reward.overlong_buffer.penalty_factor", "-1"],
     "reward.overlong_buffer.penalty_factor is -1.0"),
    # a device the machine does not have
    (["--trainer.device", "npu"], "trainer.device\": Expected one of 'auto', 'cpu', 'cuda'. Got value: npu"),
    (["--trainer.device", "xpu"], "Got value: xpu"),
    # unknown builtin: names
    (["--model.path", "builtin:huge"],
     "model.path: unknown built-in model 'builtin:huge'; valid: builtin:tiny"),
    (["--model.tokenizer_path", "builtin:tok"], "model.tokenizer_path: unknown built-in model 'builtin:tok'"),
    (["--data.train_files", "builtin:gsm9k"],
     "data.train_files: unknown built-in task 'builtin:gsm9k'; valid: builtin:arith"),
    (["--data.val_files", "[builtin:arith, builtin:nope]"], "data.val_files: unknown built-in task"),
    (["--reward_model.enable", "true", "--reward_model.model.path", "builtin:large-rm"],
     "reward_model.model.path: unknown built-in model 'builtin:large-rm'"),
    (["--data.train_files", "[]"], "data.train_files is empty; give parquet files or builtin:<task>"),
    # routing replay the rollout engine cannot feed (hf records no routing), and on a dense model
    (["--model.path", "builtin:tiny-moe", "--rollout.engine", "hf", "--actor.router_replay", "R3"],
     "actor.router_replay is R3, but rollout.engine 'hf' does not return the experts it routed each "
     "token to"),
    (["--actor.router_replay", "R2"],
     "actor.router_replay is R2, but model.path 'builtin:tiny-arith' is a dense model"),
    # expert parallelism wider than the FSDP ranks
    (["--model.path", "builtin:tiny-moe", "--parallel.ep", "2"],
     "parallel.ep is 2, which does not divide the 1 FSDP ranks (parallel.dp_shard)"),
    # a shape the plan reads, never built (30B parameters)
    (["--model.path", "builtin:qwen3-30b-a3b-shape"],
     "model.path is 'builtin:qwen3-30b-a3b-shape', a model's shape that spmdrl plans for but never "
     "builds"),
    # a LoRA rank wider than a layer it adapts (tiny: k_proj and v_proj are 256 x 128)
    (["--model.lora_rank", "129"], "model.lora_rank is 129, but k_proj of 'builtin:tiny-arith' is 256 x 128: "
                                   "a LoRA rank can be at most the narrowest side (128)"),
    (["--model.lora_rank", "300", "--model.target_modules", "[q_proj, o_proj, up_proj]"],
     "model.lora_rank is 300, but o_proj of 'builtin:tiny-arith' is 256 x 256: a LoRA rank can be at most "
     "the narrowest side (256)"),
    (["--algorithm.adv_estimator", "gae", "--critic.lora_rank", "4096"], "critic.lora_rank is 4096"),
]


@pytest.mark.parametrize("extra, fragment", VALUES, ids=[" ".join(a) for a, _ in VALUES])
def test_bad_values_exit_2_before_start_up(extra, fragment, capsys):
    assert_one_sentence(*run_main(["--config", GRPO, *extra], capsys), fragment)


def test_cuda_on_a_machine_without_one(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert_one_sentence(*run_main(["--config", GRPO, "--trainer.device", "cuda"], capsys),
                        "trainer.device is 'cuda' but no CUDA device is visible")


def _rows(n: int = 4, **columns) -> pa.Table:
    base = {"prompt": [CHAT] * n, "data_source": ["spmdrl/arith"] * n,
            "reward_model": [{"style": "rule", "ground_truth": "4"}] * n, "extra_info": [{"index": 0}] * n}
    base.update(columns)
    return pa.table({k: v for k, v in base.items() if v is not None})


ROWS = {
    "reward_model as JSON text": (
        dict(reward_model=[json.dumps({"ground_truth": "4"})] * 4),
        "column 'reward_model' of row 0 of '{f}' is the str '{{\"ground_truth\": \"4\"}}'; verl's layout "
        "has a struct there"),
    "extra_info as a string": (dict(extra_info=["index 0"] * 4), "column 'extra_info' of row 0 of '{f}'"),
    "reward_model as a bare string": (dict(reward_model=["4"] * 4), "column 'reward_model' of row 0"),
    "prompt as JSON text": (dict(prompt=[json.dumps(CHAT)] * 4), "is JSON text of chat messages"),
    "message without a role": (dict(prompt=[[{"content": "hi"}]] * 4),
                               "message 0 in column 'prompt' of row 0 of '{f}' is {{'content': 'hi'}}"),
    "message without content": (dict(prompt=[[{"role": "user"}]] * 4), "needs a string content"),
    "a role verl does not know": (dict(prompt=[[{"role": "human", "content": "hi"}]] * 4),
                                  "a role among system, user, assistant, tool"),
    "empty message list": (dict(prompt=[[]] * 4), "column 'prompt' of row 0 of '{f}' is an empty list"),
    "empty prompt": (dict(prompt=["what?", "  ", "a", "b"]), "column 'prompt' of row 1 of '{f}' is an empty"),
    "prompt a number": (dict(prompt=[1, 2, 3, 4]), "is neither a string nor a list of chat messages"),
    "no prompt column": (dict(prompt=None, question=["hi"] * 4), "has no prompt column 'prompt'"),
    "data_source not a string": (dict(data_source=[1, 2, 3, 4]), "column 'data_source' of row 0"),
    "data_source without a scorer": (
        dict(data_source=["spmdrl/arith", "openai/gsm8k", "my/math", "my/math"]),
        "row 2 of '{f}' has data_source 'my/math', which no built-in scorer handles "
        "(reward.function=builtin); known data sources: "),
    "no data_source": (dict(data_source=None), "row 0 of '{f}' has no data_source, which no built-in scorer"),
    "no reward_model column": (dict(reward_model=None), "row 0 of '{f}' has no reward_model.ground_truth"),
    "ground truth null": (dict(reward_model=[{"style": "rule", "ground_truth": None}] * 4),
                          "(4 of 4 rows lack one)"),
    "fewer rows than a batch": (dict(),
                                "data.train_files hold 4 rows, fewer than data.train_batch_size (16)"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_bad_parquet_rows_exit_2_before_start_up(case, tmp_path, capsys):
    columns, fragment = ROWS[case]
    f = tmp_path / "train.parquet"
    pq.write_table(_rows(**columns), f)
    code, err = run_main(["--config", GRPO, "--data.train_files", str(f), "--data.val_files", "null",
                          "--trainer.output_dir", str(tmp_path / "out")], capsys)
    assert_one_sentence(code, err, fragment.format(f=f))
    assert not (tmp_path / "out").exists()  # nothing was started


def test_a_bad_validation_file_names_its_key(tmp_path, capsys):
    f = tmp_path / "val.parquet"
    pq.write_table(_rows(extra_info=["x"] * 4), f)
    assert_one_sentence(*run_main(["--config", GRPO, "--data.val_files", str(f)], capsys),
                        f"data.val_files: column 'extra_info' of row 0 of '{f}'")


def test_a_folder_instead_of_a_data_file(tmp_path, capsys):
    assert_one_sentence(*run_main(["--config", GRPO, "--data.train_files", str(tmp_path)], capsys),
                        f"data.train_files names '{tmp_path}', which is a folder; give parquet files")


def test_a_reward_function_verl_could_not_call(tmp_path):
    """A signature verl's keywords do not fit raised on every item and scored 0 each time; now it stops."""
    from spmdrl.errors import ConfigError
    from spmdrl.reward.rule import RewardManager

    score = tmp_path / "score.py"
    score.write_text("def f(solution, gt):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"reward.function '.*score.py:f' cannot be called as verl calls "
                                          r"it, with the keywords data_source, solution_str, ground_truth "
                                          r"and extra_info \(missing a required argument: 'solution'\)"):
        RewardManager(f"{score}:f")


def test_good_rows_pass_and_a_map_column_reads_as_a_dict(tmp_path):
    """verl's layout passes; a map column (pandas writes dicts of one value type so) is read as dicts."""
    from spmdrl.config.inputs import check_data_files
    from spmdrl.config.parse import parse_config
    from spmdrl.data import read_rows

    f = tmp_path / "train.parquet"
    gt = pa.array([[("ground_truth", "4")]] * 16, type=pa.map_(pa.string(), pa.string()))
    pq.write_table(_rows(16, reward_model=gt), f)
    cfg, _ = parse_config(["--config", GRPO, "--data.train_files", str(f), "--data.val_files", str(f)])
    check_data_files(cfg)
    assert read_rows(str(f), "prompt")["reward_model"][0] == {"ground_truth": "4"}


def test_a_missing_ground_truth_warns_once_for_a_user_function(tmp_path, caplog):
    """A user's reward function may not need a ground truth: a warning, once per file, not an error."""
    from spmdrl.config.inputs import check_data_files
    from spmdrl.config.parse import parse_config

    f = tmp_path / "train.parquet"
    pq.write_table(_rows(16, reward_model=None), f)
    score = tmp_path / "score.py"
    score.write_text("def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg, _ = parse_config(["--config", GRPO, "--data.train_files", str(f), "--data.val_files", "null",
                           "--reward.function", f"{score}:f"])
    with caplog.at_level(logging.WARNING, logger="spmdrl"):
        check_data_files(cfg)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "16 of 16 rows" in warnings[0] and "ground_truth=None" in warnings[0]


@pytest.fixture
def folder(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _edit(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


MODELS = {
    "heads do not divide hidden_size": (dict(num_attention_heads=3, num_key_value_heads=1),
                                        "hidden_size (256) is not divisible by num_attention_heads (3)"),
    "kv heads do not divide heads": (dict(num_key_value_heads=3),
                                     "num_key_value_heads (3) does not divide num_attention_heads (4)"),
    "zero layers": (dict(num_hidden_layers=0), "num_hidden_layers is 0 in"),
    "negative hidden size": (dict(hidden_size=-256), "hidden_size is -256 in"),
    "a size as text": (dict(intermediate_size="1024"), "intermediate_size is '1024' in"),
    "unknown rope type": (dict(rope_scaling={"rope_type": "bogus", "factor": 2.0}),
                          "rope_scaling has rope_type 'bogus'"),
    "negative rope factor": (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}),
                             "rope_scaling.factor is -2.0"),
    "zero rope theta": (dict(rope_theta=0), "rope_theta is 0 in"),
    "vocab_size against the weights": (dict(vocab_size=100),
                                       "tensor 'model.embed_tokens.weight' in '{f}' has shape [2048, 256], "
                                       "but config.json makes it [100, 256]"),
    "intermediate_size against the weights": (dict(intermediate_size=512),
                                              "has shape [256, 1024], but config.json makes it [256, 512]"),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_impossible_model_configs(folder, case):
    changes, fragment = MODELS[case]
    _edit(folder, **changes)
    with pytest.raises(ValueError) as err:
        validate_model_folder(folder, "model.path")
    text = str(err.value)
    assert text.startswith("model.path") and fragment.format(f=folder) in text and "\n" not in text, text


def test_weights_the_engine_cannot_read(folder):
    _drop_tensor(folder, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"lacks 1 of the model's \d+ weights \(first: "
                                         r"'model.layers.1.mlp.down_proj.weight'\); they would start random"):
        validate_model_folder(folder, "model.path")
    # Pickled weights are refused by name, never opened: this "pickle" would run code if it were loaded.
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch pwned'\ntR.")
    with pytest.raises(ValueError, match="holds only pickled weights .* convert them to safetensors"):
        validate_model_folder(folder, "model.path")
    assert not Path("pwned").exists()


def test_vocab_smaller_than_the_tokenizer(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(ValueError,
                       match=r"vocab_size \(100\) in .* is smaller than the tokenizer's 2048 tokens"):
        check_vocab({"vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                     "intermediate_size": 8}, tok, "model.tokenizer_path", folder)


def test_a_config_without_a_key_the_engines_need(folder, capsys):
    """config.json without intermediate_size ended in KeyError: 'intermediate_size' inside an engine."""
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    code, err = run_main(["--config", GRPO, "--model.path", str(folder)], capsys)
    assert_one_sentence(code, err, f"model.path: '{folder / 'config.json'}' lacks intermediate_size, which "
                                   f"every engine needs")


def test_model_checks_run_from_the_cli(folder, tmp_path, capsys):
    _edit(folder, max_position_embeddings=32)
    code, err = run_main(["--config", GRPO, "--model.path", str(folder)], capsys)
    assert_one_sentence(code, err, "has max_position_embeddings 32, fewer than data.max_prompt_length + "
                                   "data.max_response_length = 80")
    _edit(folder, max_position_embeddings=2048, num_key_value_heads=3)
    code, err = run_main(["--config", GRPO, "--model.path", str(folder)], capsys)
    assert_one_sentence(code, err, "num_key_value_heads (3) does not divide")


def test_chat_prompts_need_a_chat_template(folder, tmp_path, capsys):
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for f in folder.glob("chat_template.*"):
        f.unlink()
    data = tmp_path / "train.parquet"
    pq.write_table(_rows(16), data)
    code, err = run_main(["--config", GRPO, "--model.path", str(folder), "--data.train_files", str(data),
                          "--data.val_files", "null"], capsys)
    assert_one_sentence(code, err, f"the data files hold chat-message prompts but the tokenizer of "
                                   f"model.path '{folder}' has no chat template")


VERL_TOOL = '''
class VerlStyleTool:
    def __init__(self, config, tool_schema):
        self._instances = {}

    async def create(self, instance_id=None, **kwargs):
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        return "42", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass
'''


def test_verl_async_tool_classes_are_refused_in_one_sentence(tmp_path, capsys):
    (tmp_path / "verl_tool.py").write_text(VERL_TOOL)
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {tmp_path / 'verl_tool.py'}:VerlStyleTool\n"
                      f"    tool_schema: {{type: function, function: {{name: calc}}}}\n")
    code, err = run_main(["--config", GRPO_TOOLS, "--rollout.multi_turn.tool_config_path", str(config)],
                         capsys)
    assert_one_sentence(code, err, "'VerlStyleTool' defines async create, execute, calc_reward, release "
                                   "(verl's BaseTool API); spmdrl expects a spmdrl.agent.tools.Tool")


def test_cli_stops_before_start_up(tmp_path):
    """The real command line: exit 2, one line, and nothing started (no process group, no output folder)."""
    f = tmp_path / "train.parquet"
    pq.write_table(_rows(16, data_source=["my/math"] * 16), f)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "spmdrl.train", "--config", GRPO, "--data.train_files",
                          str(f), "--trainer.output_dir", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith(f"spmdrl.train: error: data.train_files: row 0 of '{f}' has data_source "
                                 f"'my/math', which no built-in scorer handles")
    assert out.stderr.count("\n") == 1 and out.stdout == "" and not (tmp_path / "out").exists()


def test_a_reward_model_with_two_labels(tmp_path, capsys):
    """A classifier with a score per label (shapes consistent) is not one reward per response."""
    from safetensors.torch import load_file, save_file

    from spmdrl.builtin.models import build_model

    folder = build_model(tmp_path / "rm", "tiny", seed=0, reward=True)
    tensors = load_file(folder / "model.safetensors")
    tensors["score.weight"] = torch.cat([tensors["score.weight"]] * 2)  # [2, H]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit(folder, id2label={"0": "bad", "1": "good"}, label2id={"bad": 0, "good": 1})
    capsys.readouterr()  # building the folder printed progress bars
    code, err = run_main(["--config", GRPO, "--reward_model.enable", "true", "--reward_model.model.path",
                          str(folder)], capsys)
    assert_one_sentence(code, err, f"reward_model.model.path '{folder}' has 2 labels in config.json; the "
                                   f"reward model must output one score (num_labels 1)")


def test_a_phase_that_cannot_fit_stops_before_work_naming_the_key(capsys):
    """The memory plan finds the update of a 0.5B model on 4096-token responses in micro-batches of 512 far
    beyond any machine's memory (no model is built to find out)."""
    code, err = run_main(["--config", GRPO, "--model.path", "builtin:qwen2.5-0.5b-shape",
                          "--data.max_response_length", "4096", "--actor.ppo_micro_batch_size_per_gpu", "512",
                          "--actor.ppo_mini_batch_size", "16", "--rollout.max_num_seqs", "4",
                          "--model.enable_gradient_checkpointing", "false"], capsys)
    # (few sequences in flight keep the rollout's KV cache small, so that phase fits whatever memory this
    # machine has free and the update is the one refused)
    assert_one_sentence(code, err, "the memory plan finds that the update phase needs")
    assert "lower actor.ppo_micro_batch_size_per_gpu" in err
