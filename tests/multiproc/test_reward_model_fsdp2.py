"""The reward model through the FSDP2 engine (2 gloo ranks) scores exactly as transformers' own forward.

Each rank scores its own rows (3 on rank 0, 1 on rank 1, so the engine's forwards are padded to equal
counts); every score must equal ``AutoModelForSequenceClassification(...)(ids).logits`` of the same
rendered text run alone, unpadded.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn
from rows import fsdp2_engine

pytestmark = pytest.mark.dist

CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Copy: abc"}],
    [{"role": "user", "content": "Reverse: dog"}],
    [{"role": "user", "content": "What is 7 * 6?"}],
]
RESPONSES = ["5", "abc and then some more words to make it longer", "", "42"]
ROWS = {0: [0, 1, 2], 1: [3]}


def _scores(rank: int, world: int, model_dir: str) -> list[float]:
    from transformers import AutoTokenizer

    from spmdrl.parallel import ParallelDims
    from spmdrl.reward.model import RewardModelScorer

    dims = ParallelDims(world).build()
    engine = fsdp2_engine(model_dir, "reward", dims=dims)
    assert engine.optimizer is None and not any(p.requires_grad for p in engine.model.parameters())
    rm = RewardModelScorer(engine, AutoTokenizer.from_pretrained(model_dir), group=dims.batch_group,
                           micro_batch_size=2, max_length=None)
    mine = ROWS[rank]
    scores = rm.model_scores([CHATS[i] for i in mine], [RESPONSES[i] for i in mine]).tolist()
    assert rm.model_scores([], []).shape == (0,)  # no rank has rows: no forward, no hang
    return scores


def test_fsdp2_reward_engine_equals_transformers_forward(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from spmdrl.builtin.models import build_model
    from spmdrl.reward.model import render

    model_dir = str(build_model(tmp_path / "rm", "tiny", seed=3, reward=True))
    per_rank = spawn(_scores, 2, model_dir)
    got = per_rank[0] + per_rank[1]

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = render(tok, CHATS, RESPONSES)
    assert texts[0] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    with torch.no_grad():
        want = [float(hf(torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits[0, 0])
                for t in texts]
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(w, 4) for w in want}) == len(want)  # the random head tells the texts apart


def test_max_length_cuts_on_the_right_and_scores_the_cut_text(tmp_path) -> None:
    from spmdrl.builtin.models import build_tokenizer
    from spmdrl.reward.model import encode

    tok = build_tokenizer(tmp_path, seed=0)
    batch = encode(tok, ["<|im_start|>user\nhi<|im_end|>\n", "a b c d e f g h"], 4, tok.pad_token_id)
    assert batch["input_ids"].shape == (2, 4)
    assert batch["input_ids"][0].tolist() == tok("<|im_start|>user\nhi<|im_end|>\n",
                                                 add_special_tokens=False)["input_ids"][:4]
    short = encode(tok, ["ab", "a b c d e f g h"], None, tok.pad_token_id)
    n = int(short["attention_mask"][0].sum())
    assert short["input_ids"][0, n:].eq(tok.pad_token_id).all()  # right padding
    assert short["position_ids"][0, :n].tolist() == list(range(n))
