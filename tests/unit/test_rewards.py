"""RewardManager: builtin dispatch, user files, contained errors and timeouts, in-process and in workers."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch

from spmdrl.config import RewardConfig
from spmdrl.reward.rule import RewardManager, decode_responses, load_reward_function

USER_FILE = """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("scorer bug")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "nodict":
        return {"acc": 1.0}
    if solution_str == "none":
        return None
    if solution_str == "text":
        return "0.5"
    if solution_str == "exit":
        raise SystemExit(4)
    return {"score": float(solution_str == ground_truth), "len": len(solution_str), "idx": extra_info["i"]}

def helper():
    pass
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def _score(rm: RewardManager, sols: list[str], gts: list[str] | None = None):
    gts = gts if gts is not None else ["ok"] * len(sols)
    return rm(["custom"] * len(sols), sols, gts, [{"i": i} for i in range(len(sols))])


def test_builtin_dispatch_by_data_source() -> None:
    rm = RewardManager.from_config(RewardConfig())
    out = rm(["spmdrl/arith", "spmdrl/arith", "openai/gsm8k"], ["7", "abc", "#### 12"], ["7", "7", "12"],
             [None, None, None])
    assert torch.equal(out.scores, torch.tensor([1.0, 0.0, 1.0]))
    assert out.scores.dtype == torch.float32
    # gsm8k returns a float: no extras for it; pred is the extracted answer ("" for none) maj@k votes with.
    assert out.extra == {"acc": [1.0, 0.0, None], "pred": ["7", "", None]}
    assert out.metrics() == {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0}
    with pytest.raises(ValueError,
                       match="no built-in scorer for data_source 'mine/data'.*known data sources"):
        rm(["mine/data"], ["x"], ["y"])


def test_user_file_in_process_contains_errors(user_file: Path) -> None:
    rm = RewardManager(f"{user_file}:compute_score")
    out = _score(rm, ["ok", "raise", "bad"])
    assert out.scores.tolist() == [1.0, 0.0, 0.0]
    assert out.num_errors == 1 and out.num_timeouts == 0
    # sys.exit() in the user's function ends neither this process nor the batch
    exited = _score(rm, ["exit", "ok"])
    assert (exited.scores.tolist() == [0.0, 1.0] and exited.num_errors == 1
            and "SystemExit: 4" in exited.errors[0])
    assert "RuntimeError: scorer bug" in out.errors[0]
    assert out.extra["len"] == [2, None, 3] and out.extra["idx"] == [0, None, 2]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("solution, shown", [
    ("none", "returned None"), ("nan", "returned nan"), ("text", "returned '0.5'"),
    ("nodict", "returned a dict without 'score' (keys ['acc'])"),
])
def test_a_bad_return_value_stops_the_run(user_file: Path, workers: int, solution: str, shown: str) -> None:
    """A scorer returning None, NaN, a string or a dict without "score" is a bug that used to score 0 on every
    batch: it is a ConfigError naming the function and the value, in-process and from a worker."""
    from spmdrl.errors import ConfigError

    spec = f"{user_file}:compute_score"
    with RewardManager(spec, num_workers=workers, timeout_s=30.0) as rm:
        with pytest.raises(ConfigError) as err:
            _score(rm, ["ok", solution])
    text = str(err.value)
    assert f"reward.function {spec!r} {shown} for data_source 'custom'" in text, text
    assert "\n" not in text


def test_missing_file_and_function_errors(tmp_path: Path, user_file: Path) -> None:
    with pytest.raises(FileNotFoundError, match="reward file .*nope.py.* does not exist"):
        load_reward_function(f"{tmp_path / 'nope.py'}:compute_score")
    with pytest.raises(AttributeError,
                       match="has no function 'score_it'.*callables defined there: compute_score, helper"):
        RewardManager(f"{user_file}:score_it")
    with pytest.raises(ValueError, match="neither 'builtin' nor 'path/to/file.py:function'"):
        RewardManager("my_reward.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemError('boom at import')\n")
    with pytest.raises(ImportError, match="importing reward file .*broken.py.* failed"):
        RewardManager(f"{broken}:f")


def test_worker_pool_timeout_error_and_crash_are_contained(user_file: Path) -> None:
    with RewardManager(f"{user_file}:compute_score", num_workers=2, timeout_s=1.0) as rm:
        t0 = time.monotonic()
        out = _score(rm, ["ok", "hang", "raise", "no", "die", "ok"])
        elapsed = time.monotonic() - t0
        assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert out.num_timeouts == 1 and out.num_errors == 3  # hang, raise, die
        assert any("timed out after 1 s" in e for e in out.errors)
        assert any("worker died (exit code 3)" in e for e in out.errors)
        assert out.extra["idx"] == [0, None, None, 3, None, 5]
        assert elapsed < 20, elapsed  # the hung worker was killed, not waited for (60 s sleep)
        # The pool was rebuilt: a second batch scores normally on fresh workers.
        again = _score(rm, ["ok", "no"])
        assert again.scores.tolist() == [1.0, 0.0] and again.num_errors == 0


def test_worker_pool_builtin_matches_in_process() -> None:
    sources = ["spmdrl/arith"] * 4 + ["spmdrl/reverse"] * 2
    sols = ["7", "8", "x7", "", "dcba", "dcbx"]
    gts = ["7", "7", "7", "7", "dcba", "dcba"]
    local = RewardManager()(sources, sols, gts)
    with RewardManager(num_workers=2, timeout_s=10.0) as rm:
        pooled = rm(sources, sols, gts)
    assert torch.allclose(local.scores, pooled.scores) and local.extra == pooled.extra


def test_decode_responses(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seven = tok("7", add_special_tokens=False)["input_ids"]
    digits = tok("123456", add_special_tokens=False)["input_ids"]  # digits are single tokens
    ids = torch.tensor([seven + [tok.eos_token_id, 0, 0, 0], digits[:5]])  # [2, 5]
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    texts = decode_responses(tok, ids, mask)
    assert texts == ["7", "12345"]  # EOS and padding are not part of the scored text
