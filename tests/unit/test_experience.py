"""Experience production in one process, with scripted rollout engines: single-turn scoring, DAPO's extra
rounds, ReMax's greedy baseline, multi-turn with a real tool and validation metrics.

The engines answer from the prompt's text, so every score is known in advance; the process group is a
world of one (gloo), as ``python -m spmdrl.train`` without torchrun makes it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Iterable, Sequence

import pytest
import torch
import torch.distributed as dist

from spmdrl.agent.rollout import ToolAgent
from spmdrl.agent.tools import CALCULATOR_SCHEMA, ToolSpec
from spmdrl.builtin.tasks import generate_arith, generate_calc, write_parquet
from spmdrl.config import Config
from spmdrl.data import PromptDataset, PromptLoader, ValidationLoader
from spmdrl.experience import Experience, batch_metrics, sampling_params
from spmdrl.metrics import PhaseTimer
from spmdrl.reward.rule import RewardManager
from spmdrl.reward.scorers import arith_score, calc_score
from spmdrl.reward.sources import Rewards, RuleReward, ToolReward
from spmdrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, left_pad
from spmdrl.rollout.session import RolloutSession
from spmdrl.validation import validation_metrics

_spec = importlib.util.spec_from_file_location("scripted_policy",
                                               Path(__file__).parents[1] / "e2e" / "scripted_policy.py")
scripted = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scripted)

_QUESTION = re.compile(r"(\d+) ([-+]) (\d+)\?")  # any of the arith task's phrasings
N = 4  # responses per prompt

pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


class ArithAnswers(RolloutEngine):
    """Answers "... a op b?": greedy, and every sample of an even a, the right answer; sample j of an odd
    a, (answer + j) mod 10. So groups with an even first operand all score the same (DAPO drops them)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.calls: list[SamplingParams] = []

    def answer(self, prompt: Sequence[int], j: int, greedy: bool) -> str:
        a, op, b = _QUESTION.search(self.tok.decode(list(prompt))).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        return str(right if greedy or int(a) % 2 == 0 else (right + j) % 10)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        self.calls.append(sampling)
        rows = [self.tok.encode(self.answer(p, j, sampling.greedy), add_special_tokens=False)
                + [self.tok.eos_token_id] for p in prompts for j in range(sampling.n)]
        R = sampling.max_tokens
        ids = torch.full((len(rows), R), self.tok.pad_token_id, dtype=torch.long)  # [N, R]
        mask = torch.zeros(len(rows), R, dtype=torch.bool)
        for k, r in enumerate(rows):
            ids[k, : len(r)], mask[k, : len(r)] = torch.tensor(r), True
        idx = torch.arange(len(prompts)).repeat_interleave(sampling.n)  # [N]
        prompt_ids, prompt_mask = left_pad(prompts, self.tok.pad_token_id, torch.device("cpu"))
        logprobs = torch.zeros(len(rows), R) if sampling.logprobs else None  # as vLLM and SGLang skip them
        return GenerationOutput(prompt_ids[idx], prompt_mask[idx], ids, mask, logprobs, ["stop"] * len(rows),
                                idx)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:
            pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        pass

    @classmethod
    def from_config(cls, cfg, model_path, *, mesh, device, eos_token_ids, pad_token_id) -> "ArithAnswers":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path))


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tok, rows: list[dict], tmp_path: Path) -> PromptDataset:
    return PromptDataset(write_parquet(rows, tmp_path / "p.parquet"), tok, max_prompt_length=128)


def _experience(cfg: Config, engine: RolloutEngine, tok, sources=None, agent=None,
                baseline=False) -> Experience:
    session = RolloutSession(engine, lambda: [], sleep_level=1, sleeps=True)
    rewards = Rewards(sources or [RuleReward(RewardManager())], tok)
    return Experience(cfg, session, rewards, timer=PhaseTimer(torch.device("cpu")), group=dist.group.WORLD,
                      agent=agent, needs_baseline=baseline)


def _cfg(**algorithm) -> Config:
    cfg = Config()
    cfg.rollout.n, cfg.data.max_response_length = N, 8
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 4  # the tests' loaders: 4 prompts a step
    for key, value in algorithm.items():
        setattr(cfg.algorithm.filter_groups, key, value)
    return cfg


def test_single_turn_batch_is_scored_by_the_rule_source(tok, tmp_path) -> None:
    ds = _prompts(tok, generate_arith("train", 4, seed=0), tmp_path)
    engine = ArithAnswers(tok)
    exp = _experience(_cfg(), engine, tok)
    batch, metrics = exp.produce([ds[i] for i in range(4)], more_prompts=iter(()))
    assert len(batch) == 4 * N and batch["index"].tolist() == [i for i in range(4) for _ in range(N)]
    expected = [arith_score("spmdrl/arith", engine.answer(ds[i].prompt_ids, j, False),
                            ds[i].ground_truth)["score"]
                for i in range(4) for j in range(N)]
    assert batch["scores"].tolist() == pytest.approx(expected)
    # The score sits on each row's last response token (its EOS), nowhere else.
    last = batch["response_mask"].sum(-1).long() - 1  # [N]
    assert torch.equal(batch["token_rewards"].sum(-1), batch["scores"])
    assert torch.equal(batch["token_rewards"][torch.arange(len(batch)), last], batch["scores"])
    assert metrics["reward/num_errors"] == 0 and 0 <= metrics["reward/acc"] <= 1
    assert batch_metrics(batch)["reward/mean"] == pytest.approx(sum(expected) / len(expected))
    assert "baseline" not in batch and [c.n for c in engine.calls] == [N]
    # The engine's sleep after the window is a phase of its own (on a GPU it moves the weights to the host).
    assert {"timing/weight_sync", "timing/rollout", "timing/reward", "timing/sleep"} <= set(exp.timer.pop())


def test_dapo_generates_until_every_group_it_keeps_is_informative(tok, tmp_path) -> None:
    rows = generate_arith("train", 64, seed=0)
    ds = _prompts(tok, rows, tmp_path)
    loader = PromptLoader(ds, batch_size=4, rank=0, world_size=1, shuffle=False, seed=0)
    engine = ArithAnswers(tok)
    exp = _experience(_cfg(enable=True, max_num_gen_batches=10), engine, tok)
    prompts = next(loader)
    batch, metrics = exp.produce(prompts, more_prompts=loader)
    odd = [p for p in ds.items if int(p.extra_info["a"]) % 2 == 1]
    rounds = int(metrics["dapo/num_gen_batches"])
    seen = 4 * rounds  # prompts generated for
    assert len(batch) == 4 * N  # exactly the step's groups, whole
    kept = sorted(set(batch["index"].tolist()))
    assert kept == [p.index for p in odd if p.index < seen][:4]  # the first informative groups, in order
    assert metrics["dapo/kept_groups"] + metrics["dapo/dropped_groups"] == seen
    assert rounds == len(engine.calls) and rounds > 1


def test_dapo_rounds_draw_gen_batch_size_prompts_and_train_the_first_kept(tok, tmp_path) -> None:
    """data.gen_batch_size (verl's recipe/dapo: 3 x the batch): the loader hands out that many prompts a
    round, and the step trains on the first train_batch_size groups kept, the surplus dropped."""
    from spmdrl.data import build_train_loader

    cfg = _cfg(enable=True, max_num_gen_batches=10)
    cfg.data.train_files, cfg.data.gen_batch_size = [str(write_parquet(generate_arith("train", 64, seed=0),
                                                                        tmp_path / "t.parquet"))], 12
    cfg.data.shuffle, cfg.data.max_prompt_length = False, 128
    loader = build_train_loader(cfg.data, tok, rank=0, world_size=1, seed=0)
    engine = ArithAnswers(tok)
    prompts = next(loader)
    assert len(prompts) == 12 and loader.steps_per_epoch == 64 // 12
    batch, metrics = _experience(cfg, engine, tok).produce(prompts, more_prompts=loader)
    odd = [p.index for p in prompts if int(p.extra_info["a"]) % 2 == 1]
    assert len(odd) >= 4 and metrics["dapo/num_gen_batches"] == 1  # one round held enough
    assert sorted(set(batch["index"].tolist())) == odd[:4] and len(batch) == 4 * N
    assert metrics["dapo/kept_groups"] + metrics["dapo/dropped_groups"] == 12


def test_remax_baseline_is_the_greedy_responses_score(tok, tmp_path) -> None:
    ds = _prompts(tok, generate_arith("train", 3, seed=1), tmp_path)
    engine = ArithAnswers(tok)
    exp = _experience(_cfg(), engine, tok, baseline=True)
    batch, _ = exp.produce([ds[i] for i in range(3)], more_prompts=iter(()))
    # Greedy writes the right answer alone: the bare correct answer scores 1.
    assert batch["baseline"].tolist() == [1.0] * (3 * N)
    assert [(c.n, c.greedy) for c in engine.calls] == [(N, False), (1, True)]


def _phrased(rows: list[dict], phrasing: str) -> list[dict]:
    """``rows`` asked in one phrasing, so that a batch of them has one prompt width."""
    for r in rows:
        info = r["extra_info"]
        r["prompt"] = [{"role": "user", "content": phrasing.format(a=info["a"], op=info["op"], b=info["b"])}]
    return rows


def _rounds_of_two_widths(tok, tmp_path) -> tuple[PromptDataset, PromptLoader]:
    """Batches of 4 prompts whose first round is all short prompts and whose later rounds are long ones;
    in the first round only one group is informative (an odd first operand, ``ArithAnswers``)."""
    rows = generate_arith("train", 64, seed=0)
    odd = [k for k, r in enumerate(rows[:4]) if r["extra_info"]["a"] % 2 == 1]
    assert len(odd) < 4  # DAPO needs a second round
    rows = _phrased(rows[:4], "{a} {op} {b}?") + _phrased(rows[4:], "Please solve this question: what is "
                                                                     "{a} {op} {b}? Answer with one number.")
    ds = _prompts(tok, rows, tmp_path)
    return ds, PromptLoader(ds, batch_size=4, rank=0, world_size=1, shuffle=False, seed=0)


def test_dapo_rounds_of_different_prompt_widths_make_one_batch(tok, tmp_path) -> None:
    """Each round is left-padded to its own longest prompt: the kept groups are padded to the widest before
    they are joined, and every row still holds its own prompt and response."""
    ds, loader = _rounds_of_two_widths(tok, tmp_path)
    exp = _experience(_cfg(enable=True, max_num_gen_batches=10), ArithAnswers(tok), tok)
    batch, metrics = exp.produce(next(loader), more_prompts=loader)
    assert metrics["dapo/num_gen_batches"] > 1 and len(batch) == 4 * N
    widths = {len(ds[i].prompt_ids) for i in set(batch["index"].tolist())}
    assert len(widths) == 2  # groups of both rounds were kept
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    assert P == max(widths)
    for k in range(len(batch)):
        attn = batch["attention_mask"][k].bool()
        assert batch["input_ids"][k, :P][attn[:P]].tolist() == ds[int(batch["index"][k])].prompt_ids
        assert int(attn[P:].sum()) == int(batch["response_mask"][k].sum())  # responses right-padded
        assert batch["position_ids"][k][attn].tolist() == list(range(int(attn.sum())))


def test_remax_with_dynamic_sampling_gives_every_kept_row_its_baseline(tok, tmp_path) -> None:
    """The kept groups may come from any round: each round's prompts get their greedy baseline."""
    _, loader = _rounds_of_two_widths(tok, tmp_path)
    engine = ArithAnswers(tok)
    exp = _experience(_cfg(enable=True, max_num_gen_batches=10), engine, tok, baseline=True)
    batch, metrics = exp.produce(next(loader), more_prompts=loader)
    rounds = int(metrics["dapo/num_gen_batches"])
    assert rounds > 1 and batch["baseline"].tolist() == [1.0] * (4 * N)  # greedy answers right
    assert [(c.n, c.greedy) for c in engine.calls] == [(N, False), (1, True)] * rounds


def test_dapo_stops_drawing_when_the_epochs_run_out(tok, tmp_path) -> None:
    """With trainer.total_epochs ending the run, dynamic sampling trains on the groups it kept once the
    loader's epochs are used up instead of failing with StopIteration."""
    rows = [r for r in generate_arith("train", 200, seed=0) if r["extra_info"]["a"] % 2 == 0][:7]
    rows += [r for r in generate_arith("train", 200, seed=0) if r["extra_info"]["a"] % 2 == 1][:1]
    ds = _prompts(tok, rows, tmp_path)  # 8 prompts, one informative (the last)
    loader = PromptLoader(ds, batch_size=4, rank=0, world_size=1, shuffle=False, seed=0, num_epochs=1)
    exp = _experience(_cfg(enable=True, max_num_gen_batches=10), ArithAnswers(tok), tok)
    batch, metrics = exp.produce(next(loader), more_prompts=loader)
    assert metrics["dapo/num_gen_batches"] == 2 and batch["index"].tolist() == [7] * N
    assert loader.exhausted


@pytest.mark.parametrize("multi_turn", [False, True])
def test_rollout_log_probs_only_when_asked_for(tok, tmp_path, multi_turn) -> None:
    """rollout.calculate_log_probs false: the engine is told, and the batch has no rollout_logp (so the
    rollout gap metrics are left out), whether the engine returns none (vLLM, SGLang) or some anyway."""
    cfg = _cfg()
    cfg.data.max_response_length = 256
    for calc in (True, False):
        cfg.rollout.calculate_log_probs = calc
        if multi_turn:
            ds = _prompts(tok, generate_calc("train", 2, seed=0), tmp_path)
            engine = scripted.ScriptedRollout(tok, tok.eos_token_id, tok.pad_token_id)
            agent = ToolAgent([ToolSpec("calculator", {}, CALCULATOR_SCHEMA)], tok, [tok.eos_token_id],
                              num_workers=1)
        else:
            ds, agent = _prompts(tok, generate_arith("train", 2, seed=0), tmp_path), None
            engine = ArithAnswers(tok)
        try:
            exp = _experience(cfg, engine, tok, agent=agent)
            batch, _ = exp.produce([ds[0], ds[1]], more_prompts=iter(()))
        finally:
            if agent is not None:
                agent.close()
        assert ("rollout_logp" in batch) is calc and len(batch) == 2 * N
        if not multi_turn:
            assert [c.logprobs for c in engine.calls] == [calc]


def test_multi_turn_adds_the_tools_reward_and_the_conversation(tok, tmp_path) -> None:
    ds = _prompts(tok, generate_calc("train", 2, seed=0), tmp_path)
    cfg = _cfg()
    cfg.data.max_response_length = 256
    engine = scripted.ScriptedRollout(tok, tok.eos_token_id, tok.pad_token_id)
    agent = ToolAgent([ToolSpec("calculator", {}, CALCULATOR_SCHEMA)], tok, [tok.eos_token_id], num_workers=1)
    try:
        exp = _experience(cfg, engine, tok, [RuleReward(RewardManager()), ToolReward()], agent)
        batch, metrics = exp.produce([ds[0], ds[1]], more_prompts=iter(()))
    finally:
        agent.close()
    info = batch["extra_info"]
    # Sample 0 calls the calculator correctly and answers with its output: the right answer, scored 1.
    assert [i["num_turns"] for i in info[:N]] == [2, 1, 2, 2]
    expected = [calc_score("spmdrl/calc", "", ds[k // N].ground_truth, info[k]) for k in range(2 * N)]
    assert batch["scores"].tolist() == pytest.approx([e["score"] for e in expected])
    assert batch["scores"][0] == 1.0 and torch.equal(batch["tool_reward"], torch.zeros(2 * N))
    assert metrics["reward/tool_used"] == pytest.approx(0.25)  # sample 0 of each prompt


def test_validation_metrics_from_the_same_experience(tok, tmp_path) -> None:
    ds = _prompts(tok, generate_arith("val", 6, seed=0), tmp_path)
    cfg = _cfg()
    cfg.rollout.val_kwargs.n = 2
    engine = ArithAnswers(tok)
    exp = _experience(cfg, engine, tok)
    metrics = validation_metrics(exp, ValidationLoader(ds, batch_size=4, rank=0, world_size=1))
    # Validation is greedy by default: every answer is right.
    assert metrics["val-core/spmdrl/arith/acc/mean@2"] == 1.0
    assert metrics["val-core/spmdrl/arith/acc/pass@2"] == 1.0
    assert all(c.greedy and c.n == 2 for c in engine.calls) and len(engine.calls) == 2
    assert sampling_params(cfg, validation=True).n == 2


def test_a_reward_function_failing_on_every_response_stops_the_step(tok, tmp_path) -> None:
    """sys.exit(0) on every item would train on zero reward, with only a counter to show it: one sentence
    naming the function and the first error instead. Failures on some items score 0 and are kept for the
    step's one warning."""
    from spmdrl.errors import ConfigError

    reward = tmp_path / "reward.py"
    reward.write_text("import sys\n"
                      "def always(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    sys.exit(0)\n"
                      "def sometimes(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if extra_info['a'] % 2:\n        raise ValueError('odd a')\n    return 1.0\n")
    ds = _prompts(tok, generate_arith("train", 4, seed=0), tmp_path)
    prompts = [ds[i] for i in range(4)]
    cfg = _cfg()
    cfg.reward.function = f"{reward}:always"
    exp = _experience(cfg, ArithAnswers(tok), tok, [RuleReward(RewardManager(cfg.reward.function))])
    with pytest.raises(ConfigError, match=r"reward.function '.*:always' failed on every one of the 16 "
                                          r"responses of this step \(first error: SystemExit: 0\)"):
        exp.produce(prompts, more_prompts=iter(()))
    cfg.reward.function = f"{reward}:sometimes"
    exp = _experience(cfg, ArithAnswers(tok), tok, [RuleReward(RewardManager(cfg.reward.function))])
    batch, metrics = exp.produce(prompts, more_prompts=iter(()))
    odd = sum(p.extra_info["a"] % 2 for p in prompts) * N
    assert 0 < odd < len(batch) and metrics["reward/num_errors"] == odd
    failures = exp.pop_failures()
    assert len(failures) == odd and failures[0] == "ValueError: odd a" and exp.pop_failures() == []
