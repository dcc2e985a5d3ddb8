"""Built-in tasks, their scorers (hand-checked values) and the parquet writer / builtin: resolver."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest

from spmdrl.builtin import tasks
from spmdrl.reward import scorers


def test_arith_rows_follow_verl_layout_and_are_reproducible() -> None:
    rows = tasks.generate_arith("train", 200, seed=3)
    assert rows == tasks.generate_arith("train", 200, seed=3)
    assert rows != tasks.generate_arith("val", 200, seed=3)
    for i, r in enumerate(rows):
        assert r["data_source"] == "spmdrl/arith" and r["ability"] == "math"
        assert r["prompt"][0]["role"] == "user"
        info = r["extra_info"]
        assert info["split"] == "train" and info["index"] == i
        a, b, op = info["a"], info["b"], info["op"]
        assert r["prompt"][0]["content"] in [p.format(a=a, op=op, b=b) for p in tasks.ARITH_PHRASINGS]
        ans = a + b if op == "+" else a - b
        assert 0 <= min(a, b) and max(a, b) <= 9
        assert 0 <= ans <= 9 and r["reward_model"] == {"style": "rule", "ground_truth": str(ans)}
    # Every phrasing is used, so prompts come in several token lengths.
    assert {r["prompt"][0]["content"].split(str(r["extra_info"]["a"]))[0] for r in rows} == {
        p.split("{a}")[0] for p in tasks.ARITH_PHRASINGS}
    answers = [int(r["reward_model"]["ground_truth"]) for r in tasks.generate_arith("train", 2000, seed=0)]
    # near uniform: no constant guess wins
    assert max(answers.count(d) for d in range(10)) < 0.13 * len(answers)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("7", 1.0),  # bare correct answer: the optimum
        ("7<|im_end|>", 1.0),  # special token text left in by the decoder does not count as junk
        (" 7\n", 1.0),
        ("x7", 1 / 2),  # right digit, half the text is junk
        ("7 and more", 1 / 10),
        ("8", 0.1),  # off by one: format credit only, however near
        ("2", 0.1),
        ("5 is it", 0.1 / 7),  # the format credit shrinks with extra text too
        ("17 apples", 0.1 / 9),  # the first integer is 17
        ("5555555555555555", 0.1 / 16),  # a long digit run is neither right nor concise
        ("the answer", 0.0),  # no integer at all
        ("", 0.0),
    ],
)
def test_arith_score_hand_values(response: str, expected: float) -> None:
    assert scorers.arith_score("spmdrl/arith", response, "7")["score"] == pytest.approx(expected)


def test_arith_score_optimum_is_bare_answer() -> None:
    best = scorers.arith_score("spmdrl/arith", "3", "3")["score"]
    for other in ["3z", "3 and", "a3", "33", "2", "4", "", "3 + 0 = 3"]:
        assert scorers.arith_score("spmdrl/arith", other, "3")["score"] < best


def test_random_policy_earns_almost_nothing(tiny_model_dir) -> None:
    """A uniform policy over the tiny vocabulary (16 tokens or EOS) earns almost nothing: its digits come with
    junk around them, which shrinks the format credit. That is why RL starts from the SFT warm start."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    rows = tasks.generate_arith("train", 2000, seed=0)
    scores = []
    for r in rows:
        ids = []
        for _ in range(16):
            ids.append(rng.randrange(len(tok)))
            if ids[-1] == tok.eos_token_id:
                break
        text = tok.decode(ids, skip_special_tokens=True)
        scores.append(scorers.arith_score(r["data_source"], text, r["reward_model"]["ground_truth"])["score"])
    mean = sum(scores) / len(scores)
    nonzero = sum(s > 0 for s in scores) / len(scores)
    # Measured: mean ~0.0004; ~7% of responses contain a digit, each earning a sliver of the format credit.
    assert 0 < mean < 0.002
    assert 0.03 < nonzero < 0.15


def test_string_tasks_and_score() -> None:
    rev = tasks.generate_reverse("train", 50, seed=0)
    for r in rev:
        word = r["prompt"][0]["content"].removeprefix("Reverse: ")
        assert r["reward_model"]["ground_truth"] == word[::-1] and 3 <= len(word) <= 5
    cp = tasks.generate_copy("val", 5, seed=0)[0]
    assert cp["reward_model"]["ground_truth"] == cp["prompt"][0]["content"].removeprefix("Copy: ")
    assert scorers.string_match_score("spmdrl/reverse", "dcba<|im_end|>", "dcba")["score"] == 1.0
    assert scorers.string_match_score("spmdrl/reverse", "dcbx", "dcba")["score"] == pytest.approx(0.9 * 0.75)
    assert scorers.string_match_score("spmdrl/reverse", "zzz", "dcba")["score"] == 0.0


@pytest.mark.parametrize(
    "response, gt, method, expected",
    [
        ("so 3+4=7 #### 7", "7", "strict", 1.0),
        ("#### 1,234.", "1234", "strict", 1.0),
        ("#### $18", "18", "strict", 1.0),
        ("#### 5 then #### 6", "6", "strict", 1.0),  # the last marker wins
        ("#### 8", "7", "strict", 0.0),
        ("the answer is 7", "7", "strict", 0.0),  # strict needs the marker
        ("the answer is 7.", "7", "flexible", 1.0),
        ("Natalia sold 48/2 = 24 ... #### 72", "Natalia sold ... #### 72", "strict", 1.0),
    ],
)
def test_gsm8k_score(response: str, gt: str, method: str, expected: float) -> None:
    assert scorers.gsm8k_score("openai/gsm8k", response, gt, method=method) == expected


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
        ("\\boxed{0.50}", ".5", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\\text{(A)}}", "(A)", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("first \\boxed{2} then \\boxed{\\sqrt{3}}", "\\boxed{\\sqrt{3}}", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),
        ("\\boxed{4", "4", 0.0),  # unbalanced braces: no answer
    ],
)
def test_math_score(response: str, gt: str, expected: float) -> None:
    assert scorers.math_score("lighteval/MATH", response, gt) == expected


def test_scorer_registry() -> None:
    assert scorers.compute_score("spmdrl/arith", "4", "4")["score"] == 1.0
    assert scorers.compute_score("openai/gsm8k", "#### 4", "4") == 1.0
    with pytest.raises(ValueError, match="known data sources: .*spmdrl/arith"):
        scorers.get_scorer("nope/data")
    with pytest.raises(ValueError, match="valid tasks: arith, arith_sft, calc, copy, reverse"):
        tasks.get_task("sort")


def test_make_task_cli_writes_parquet(tmp_path, capsys) -> None:
    tasks.main(["--out", str(tmp_path / "d"), "--task", "reverse", "--train-size", "40", "--val-size", "7",
                    "--seed", "2"])
    train = pq.read_table(tmp_path / "d" / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "d" / "val.parquet").to_pylist()
    assert len(train) == 40 and len(val) == 7
    assert train == tasks.generate_reverse("train", 40, seed=2)
    assert not [p for p in (tmp_path / "d").iterdir() if p.suffix == ".tmp"]
    assert "wrote" in capsys.readouterr().out


def test_resolve_builtin_data_builds_once_under_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPMDRL_CACHE", str(tmp_path))
    path = tasks.resolve_builtin_data("builtin:arith", "val", seed=5)
    assert path.startswith(str(tmp_path / "data")) and path.endswith("val.parquet")
    mtime = (tmp_path / "data").stat().st_mtime_ns
    train = tasks.resolve_builtin_data("builtin:arith", "train", seed=5)
    assert pq.read_metadata(train).num_rows == tasks.DEFAULT_TRAIN_SIZE
    assert pq.read_metadata(path).num_rows == tasks.DEFAULT_VAL_SIZE
    assert (tmp_path / "data").stat().st_mtime_ns == mtime  # second call reused the files
    assert tasks.resolve_builtin_data("/some/file.parquet", "train") == "/some/file.parquet"
    with pytest.raises(ValueError, match="valid: builtin:arith"):
        tasks.resolve_builtin_data("builtin:sort", "train")
    with pytest.raises(ValueError, match="valid splits: train, val"):
        tasks.resolve_builtin_data("builtin:arith", "test")


def test_calc_task_and_scorer() -> None:
    rows = tasks.generate_calc("train", 50, 0)
    assert rows == tasks.generate_calc("train", 50, 0) and rows != tasks.generate_calc("val", 50, 0)
    for r in rows:
        info = r["extra_info"]
        value = info["a"] * info["b"] if info["op"] == "*" else info["a"] + info["b"]
        assert r["reward_model"]["ground_truth"] == str(value) and len(str(value)) >= 5
        assert "<tool_call>" in r["prompt"][0]["content"]
    score = scorers.get_scorer("spmdrl/calc")
    ok_call = {"tool_calls": [{"name": "calculator", "error": ""}]}
    # The answer is read from the last assistant message, never from the tool output before it.
    conv = {"messages": [{"role": "assistant", "content": "<tool_call>..."},
                         {"role": "tool", "content": "391"},
                         {"role": "assistant", "content": "Answer: 390"}], **ok_call}
    assert score("spmdrl/calc", "Answer: 391", "391", conv)["score"] == 0.2
    conv["messages"][-1]["content"] = "so Answer: 391"
    assert score("spmdrl/calc", "", "391", conv) == {"score": 1.0, "acc": 1.0, "tool_used": 1.0}
    assert score("spmdrl/calc", "Answer: 7<|im_end|>", "391")["score"] == 0.1
    assert score("spmdrl/calc", "391", "391")["score"] == 0.0
    failed = {"tool_calls": [{"name": "calculator", "error": "ValueError: division by zero"}]}
    assert score("spmdrl/calc", "no answer", "391", failed)["score"] == 0.0


@pytest.mark.parametrize("module", ["spmdrl.builtin.models", "spmdrl.builtin.tasks"])
def test_the_builders_run_as_modules_without_runpys_warning(module):
    """The package no longer imports its builders at import time, so ``python -m`` finds them unimported."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "RuntimeWarning" not in done.stderr, done.stderr
    assert done.stdout.startswith("usage:")
