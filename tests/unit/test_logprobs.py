"""The log-prob / entropy kernel against hand-computed values and autograd's log_softmax."""

import math

import pytest
import torch

from spmdrl.engines import logprobs
from spmdrl.engines.logprobs import entropy_from_logits, logprobs_from_logits, token_logprobs

T = torch.tensor


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


LOGITS = T([[[0.0, 0.0], [0.0, math.log(3.0)]], [[0.0, 1000.0], [-1000.0, 0.0]]])  # [2, 2, V=2]


def test_entropy_from_logits():
    # uniform over 2: ln 2; probs 1/4, 3/4: -(1/4 ln 1/4 + 3/4 ln 3/4); near one-hot: 0 and finite
    close(entropy_from_logits(LOGITS), [[0.6931471805599453, 0.5623351446188083], [0.0, 0.0]])
    close(entropy_from_logits(torch.zeros(4)), math.log(4))


def test_logprobs_from_logits_and_gradient():
    logits = LOGITS.clone().requires_grad_(True)
    labels = T([[1, 1], [0, 1]])
    lp = logprobs_from_logits(logits, labels)
    close(lp, [[math.log(0.5), math.log(0.75)], [-1000.0, 0.0]])
    lp[0, 1].backward()
    # d log p_label / d logits = onehot - softmax = [0 - 1/4, 1 - 3/4]
    close(logits.grad[0, 1], [-0.25, 0.25])


def test_logprobs_and_entropy_in_chunks(monkeypatch):
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 2)  # one row of V=2 per chunk
    labels = T([[1, 0], [1, 1]])
    close(logprobs_from_logits(LOGITS, labels), [[math.log(0.5), math.log(0.25)], [0.0, 0.0]])
    close(entropy_from_logits(LOGITS), [[0.6931471805599453, 0.5623351446188083], [0.0, 0.0]])


def test_logprobs_upcast_low_precision():
    lp = logprobs_from_logits(LOGITS[0].to(torch.bfloat16), T([1, 1]))
    assert lp.dtype == torch.float32
    close(lp, [math.log(0.5), math.log(0.75)], atol=1e-2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 7 * 5])  # whole block, or 5 rows of V=7 per chunk
def test_token_logprobs_matches_autograd(monkeypatch, temperature, chunk):
    if chunk:
        monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 4, 7)).requires_grad_(True)
    labels = torch.randint(0, 7, (3, 4))
    weights = torch.randn(3, 4)
    ls = torch.log_softmax(logits / temperature, -1)
    want = ls.gather(-1, labels[..., None]).squeeze(-1)
    (want * weights).sum().backward()
    want_grad, logits.grad = logits.grad, None

    logp, entropy = token_logprobs(logits, labels, temperature, with_entropy=True)
    (logp * weights).sum().backward()
    assert torch.allclose(logp, want, atol=1e-6)
    assert torch.allclose(logits.grad, want_grad, atol=1e-6)
    assert not entropy.requires_grad
    assert torch.allclose(entropy, entropy_from_logits(logits.detach() / temperature), atol=1e-5)
    assert token_logprobs(logits, labels)[1] is None


def test_token_logprobs_bf16_gradient_dtype():
    logits = torch.randn(5, 11).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 11, (5,))
    logp, _ = token_logprobs(logits, labels)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    ref = torch.softmax(logits.detach().float(), -1).neg().scatter_add(-1, labels[:, None], torch.ones(5, 1))
    assert torch.allclose(logits.grad.float(), ref, atol=1e-2)


def test_logprobs_and_entropy_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 30  # large logits: the stable forms must not overflow
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    ls = torch.log_softmax(logits, -1)
    assert torch.allclose(
        logprobs_from_logits(logits, tokens), ls.gather(-1, tokens[..., None]).squeeze(-1), atol=1e-5
    )
    assert torch.allclose(entropy_from_logits(logits), -(ls.exp() * ls).sum(-1), atol=1e-4)
