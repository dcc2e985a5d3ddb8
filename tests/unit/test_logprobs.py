"""The fused log-prob / entropy kernel against hand-computed values and a plain torch reference (logits =
h W^T / T, log_softmax, gather, entropy, autograd's gradients), and its memory: no [tokens x vocabulary]
tensor."""

import math

import pytest
import torch

from spmdrl.engines import logprobs
from spmdrl.engines.logprobs import token_outputs

T = torch.tensor


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


def reference(hidden, weight, labels, temperature=1.0):
    """(logp, entropy) [...] float32 the plain way: the whole [..., V] logits, autograd for gradients."""
    logits = (hidden @ weight.T).float() / temperature  # [..., V]
    ls = torch.log_softmax(logits, -1)
    return ls.gather(-1, labels[..., None])[..., 0], -(ls.exp() * ls).sum(-1)


LOGITS = T([[[0.0, 0.0], [0.0, math.log(3.0)]], [[0.0, 1000.0], [-1000.0, 0.0]]])  # [2, 2, V=2]
EYE = torch.eye(2)  # with W = I the hidden states are the logits


def test_hand_computed_values_and_gradient():
    hidden = LOGITS.clone().requires_grad_(True)
    out = token_outputs(hidden, EYE, T([[1, 1], [0, 1]]), 1.0, with_entropy=True)
    close(out["logp"], [[math.log(0.5), math.log(0.75)], [-1000.0, 0.0]])
    # uniform over 2: ln 2; probs 1/4, 3/4: -(1/4 ln 1/4 + 3/4 ln 3/4); near one-hot: 0 and finite
    close(out["entropy"], [[0.6931471805599453, 0.5623351446188083], [0.0, 0.0]])
    out["logp"][0, 1].backward()
    # d log p_label / d logits = onehot - softmax = [0 - 1/4, 1 - 3/4]
    close(hidden.grad[0, 1], [-0.25, 0.25])
    assert not out["entropy"].requires_grad  # a metric unless entropy_grad
    assert token_outputs(hidden, EYE, T([[1, 1], [0, 1]]), 1.0, with_entropy=False).keys() == {"logp"}


def test_one_vocabulary_row_per_block(monkeypatch):
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 2)  # 4 tokens: blocks of one row of the head
    out = token_outputs(LOGITS, EYE, T([[1, 0], [1, 1]]), 1.0, with_entropy=True)
    close(out["logp"], [[math.log(0.5), math.log(0.25)], [0.0, 0.0]])
    close(out["entropy"], [[0.6931471805599453, 0.5623351446188083], [0.0, 0.0]])


def _case(tied: bool, vocab: int = 11, width: int = 8):
    """(source params, hidden, weight, labels) of 3 x 4 tokens: with ``tied`` the hidden states are made
    from the head's own rows (an embedding), so the head's gradient has both paths."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(vocab, width, generator=g)).requires_grad_(True)  # [V, H]
    ids = torch.randint(0, vocab, (3, 4), generator=g)
    mix = torch.randn(width, width, generator=g).requires_grad_(True)
    source = weight[ids] if tied else 2 * torch.randn(3, 4, width, generator=g)
    hidden = 3 * torch.tanh(source @ mix)  # [3, 4, H]
    labels = torch.randint(0, vocab, (3, 4), generator=g)
    return mix, hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 55])  # the whole head at once, or 12 tokens x 4 rows per block
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_matches_the_plain_reference(monkeypatch, temperature, chunk, entropy_grad, tied):
    if chunk:
        monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def run(fn):
        mix, hidden, weight, labels = _case(tied)
        logp, entropy = fn(hidden, weight, labels)
        loss = (logp * a).sum() + ((entropy * b).sum() if entropy_grad else 0)
        loss.backward()
        return logp.detach(), entropy.detach(), mix.grad, weight.grad

    want = run(lambda h, w, y: reference(h, w, y, temperature))
    got = run(lambda h, w, y: tuple(token_outputs(h, w, y, temperature, True, entropy_grad).values()))
    for x, y in zip(got, want):  # gradients reach ~20, where float32 rounding alone is 2e-6 a step
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_padded_vocabulary_rows_stay_out():
    _, hidden, weight, labels = _case(tied=False)
    padded = torch.cat([weight.detach(), torch.full((5, weight.shape[1]), 9.0)]).requires_grad_(True)
    out = token_outputs(hidden.detach(), padded, labels, 0.7, with_entropy=True, vocab=weight.shape[0])
    out["logp"].sum().backward()
    logp, entropy = reference(hidden.detach(), weight.detach(), labels, 0.7)
    torch.testing.assert_close(out["logp"], logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"], entropy, atol=1e-5, rtol=0)
    assert padded.grad[weight.shape[0]:].abs().max() == 0


def test_frozen_head_gets_no_gradient():
    _, hidden, weight, labels = _case(tied=False)
    frozen = weight.detach()
    token_outputs(hidden, frozen, labels, 1.0, with_entropy=False)["logp"].sum().backward()
    assert frozen.grad is None


def test_bf16_weights_and_autocast():
    mix, hidden, weight, labels = _case(tied=False, vocab=50, width=16)
    h, w = hidden.detach(), weight.detach()
    want_logp, _ = reference(h, w, labels)
    want_grad = torch.func.grad(lambda hh: reference(hh, w, labels)[0].sum())(h)
    # bf16 weights and hidden states (FSDP2's mixed precision): float32 outputs, bf16 gradients.
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    out = token_outputs(hb, wb, labels, 1.0, with_entropy=False)
    out["logp"].sum().backward()
    assert out["logp"].dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out["logp"], want_logp, atol=0.1, rtol=0)
    torch.testing.assert_close(hb.grad.float(), want_grad, atol=0.05, rtol=0.05)
    # float32 weights under bf16 autocast (Megatron's mixed precision): bf16 matmuls, float32 gradients.
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_outputs(hf, wf, labels, 1.0, with_entropy=False)
        out["logp"].sum().backward()
    assert hf.grad.dtype == wf.grad.dtype == torch.float32
    torch.testing.assert_close(out["logp"], want_logp, atol=0.1, rtol=0)
    torch.testing.assert_close(hf.grad, want_grad, atol=0.05, rtol=0.05)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_no_tokens_by_vocabulary_tensor(monkeypatch):
    """4096 tokens x 32768 ids: float32 logits would be 512 MiB (the plain reference peaks 2.5 GiB above
    its start). With chunks of 2^20 logits (4 MiB) forward and backward stay far below one such tensor
    (~20 MiB measured: the head's gradient and a few chunks)."""
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 1 << 20)
    n, vocab, width = 4096, 32768, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, width, generator=g).requires_grad_(True)
    weight = (0.1 * torch.randn(vocab, width, generator=g)).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    dense = n * vocab * 4
    warm = token_outputs(hidden[:64], weight, labels[:64], 0.7, with_entropy=True, entropy_grad=True)
    (warm["logp"].sum() + warm["entropy"].sum()).backward()  # code paths loaded before the peak is reset
    weight.grad = hidden.grad = None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart the peak from the current resident set
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")
    before = _peak_rss_bytes()
    out = token_outputs(hidden, weight, labels, 0.7, with_entropy=True, entropy_grad=True)
    (out["logp"].sum() + out["entropy"].sum()).backward()
    assert _peak_rss_bytes() - before < dense / 8
