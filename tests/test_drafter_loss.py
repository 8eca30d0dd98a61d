"""The training loss, computed chunk by chunk with a hand-written backward, equals the textbook
soft cross-entropy — value, gradient and accuracy counts — at every TTT step and chunking."""

import pytest
import torch
import torch.nn.functional as F

from eyas.families.eagle3.loss import step_loss, target_signal
from eyas.families.eagle3.ttt import shift_left


def textbook(logits, signal, loss_mask, step):
    """Soft cross-entropy to the target's draft-vocabulary distribution, written out in full tensors."""
    shift = 1 + step
    weight = (shift_left(loss_mask, shift + 1) > 0) & shift_left(signal.in_draft, shift, fill=False)
    per_position = -(shift_left(signal.probs, shift) * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    loss = (per_position * weight.float()).sum() / weight.float().sum().clamp(min=1.0)
    correct = ((logits.argmax(-1) == shift_left(signal.argmax, shift)) & weight).sum()
    return loss, correct


@pytest.mark.parametrize("step", [0, 2, 6])
@pytest.mark.parametrize("chunk_tokens", [1, 32, 4096])  # one row per chunk, two rows, every row at once
def test_chunked_loss_equals_textbook_loss(step, chunk_tokens):
    gen = torch.Generator().manual_seed(step * 10 + chunk_tokens)
    batch, tokens, width, vocab = 3, 16, 16, 40
    draft_ids = torch.sort(torch.randperm(vocab, generator=gen)[:25]).values
    head = torch.randn(vocab, width, generator=gen)
    signal = target_signal(torch.randn(batch, tokens, width, generator=gen), head, draft_ids, chunk_tokens=5)
    assert signal.in_draft.any() and not signal.in_draft.all()  # both kinds of positions are exercised
    loss_mask = (torch.rand(batch, tokens, generator=gen) > 0.3).to(torch.uint8)
    logits = (3 * torch.randn(batch, tokens, len(draft_ids), generator=gen)).requires_grad_()

    result = step_loss(logits, signal, loss_mask, step, chunk_tokens=chunk_tokens)
    result.loss.backward()
    got_grad, logits.grad = logits.grad, None
    expected, expected_correct = textbook(logits, signal, loss_mask, step)
    expected.backward()

    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, logits.grad, rtol=1e-5, atol=1e-7)
    assert int(result.correct) == int(expected_correct) == int(result.hits.sum())
    assert got_grad.abs().sum() > 0


def test_an_empty_step_has_no_loss_and_no_gradient():
    """A batch shorter than the step's shift: nothing is counted, and nothing is NaN."""
    draft_ids = torch.arange(10)
    signal = target_signal(torch.randn(2, 3, 4), torch.randn(10, 4), draft_ids)
    logits = torch.randn(2, 3, 10, requires_grad=True)
    result = step_loss(logits, signal, torch.ones(2, 3, dtype=torch.uint8), step=4)
    result.loss.backward()
    assert float(result.loss.detach()) == 0.0 and float(result.count) == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("objective", ["kl", "lk-lambda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_compute_what_the_eager_ones_do(dtype, objective):
    """On CUDA the chunk arithmetic is fused by torch.compile — the soft cross-entropy's and, for the LK losses, the
    acceptance α's (lk-lambda reads both); the compiled functions (here on the CPU) give the eager loss, gradient and
    counts, over chunks of several shapes (dynamic shapes)."""
    from eyas.families.eagle3 import loss as loss_module
    gen = torch.Generator().manual_seed(5)
    batch, tokens, width, vocab = 3, 12, 16, 40
    draft_ids = torch.arange(0, vocab, 2)
    signal = target_signal(torch.randn(batch, tokens, width, generator=gen), torch.randn(vocab, width, generator=gen),
                           draft_ids, mass=objective != "kl")
    loss_mask = torch.ones(batch, tokens, dtype=torch.uint8)
    base = (3 * torch.randn(batch, tokens, len(draft_ids), generator=gen)).to(dtype)
    results = {}
    for compile in (False, True):
        for step in (0, 3):
            logits = base.clone().requires_grad_()
            result = step_loss(logits, signal, loss_mask, step, chunk_tokens=24, compile=compile,  # 2 rows, then 1
                               objective=objective)
            result.loss.backward()
            results[compile, step] = (result.loss.detach(), logits.grad, int(result.correct))
    for step in (0, 3):
        (eager_loss, eager_grad, eager_correct), (loss, grad, correct) = results[False, step], results[True, step]
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6)
        assert correct == eager_correct
    assert not loss_module._KERNELS.compile_failed  # the compiled functions really ran


def test_a_loss_whose_compilation_fails_is_computed_eagerly(monkeypatch, caplog):
    from eyas.families.eagle3 import loss as loss_module

    def broken_compile(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("no compiler here")
        return fails

    monkeypatch.setattr(loss_module.torch, "compile", broken_compile)
    monkeypatch.setattr(loss_module, "_KERNELS", loss_module._ChunkKernels())
    gen = torch.Generator().manual_seed(6)
    signal = target_signal(torch.randn(2, 6, 8, generator=gen), torch.randn(20, 8, generator=gen), torch.arange(20))
    logits = torch.randn(2, 6, 20, generator=gen, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.uint8)
    with caplog.at_level("WARNING"):
        result = step_loss(logits, signal, mask, 0, compile=True)
        result.loss.backward()
    expected, _ = textbook(logits, signal, mask, 0)
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    assert "could not be compiled" in caplog.text and loss_module._KERNELS.compile_failed


def textbook_lk(logits, signal, loss_mask, step, head_logits, draft_ids, objective, decay=1.0):
    """The LK losses written out in full tensors: α from the target's own distribution over the whole vocabulary, read
    at the draft tokens, against the drafter's softmax."""
    shift = 1 + step
    weight = ((shift_left(loss_mask, shift + 1) > 0) & shift_left(signal.in_draft, shift, fill=False)).float()
    p = shift_left(torch.softmax(head_logits, -1)[..., draft_ids], shift)
    alpha = torch.minimum(p, torch.softmax(logits.float(), -1)).sum(-1)
    count = weight.sum().clamp(min=1.0)
    if objective == "lk-alpha":
        return -(torch.log(alpha.clamp(min=1e-30)) * weight).sum() / count
    kl, _ = textbook(logits, signal, loss_mask, step)
    mean = (alpha * weight).sum() / count
    w = torch.exp(-decay * mean.detach())
    return w * kl + (1 - w) * (1 - mean)


@pytest.mark.parametrize("objective", ["lk-alpha", "lk-lambda"])
@pytest.mark.parametrize("step, chunk_tokens", [(0, 4096), (2, 16), (1, 1)])
def test_lk_losses_equal_their_textbook_value_and_gradient(objective, step, chunk_tokens):
    """--objective lk-alpha / lk-lambda (arXiv 2602.23881): α = Σ min(p, q) over the draft vocabulary with p the
    target's own probabilities (the teacher's times the mass it gives the draft vocabulary); value and gradient equal
    the written-out expression's, chunked or not."""
    gen = torch.Generator().manual_seed(7 + step)
    batch, tokens, width, vocab = 3, 12, 16, 40
    draft_ids = torch.sort(torch.randperm(vocab, generator=gen)[:25]).values
    head, final = torch.randn(vocab, width, generator=gen), torch.randn(batch, tokens, width, generator=gen)
    signal = target_signal(final, head, draft_ids, chunk_tokens=5, mass=True)
    loss_mask = (torch.rand(batch, tokens, generator=gen) > 0.3).to(torch.uint8)
    logits = (2 * torch.randn(batch, tokens, len(draft_ids), generator=gen)).requires_grad_()

    result = step_loss(logits, signal, loss_mask, step, chunk_tokens=chunk_tokens, objective=objective, lk_decay=0.7)
    result.loss.backward()
    got_grad, logits.grad = logits.grad, None
    expected = textbook_lk(logits, signal, loss_mask, step, final @ head.T, draft_ids, objective, decay=0.7)
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, logits.grad, rtol=1e-4, atol=1e-7)
    assert got_grad.abs().sum() > 0
    kl = step_loss(logits.detach(), signal, loss_mask, step).loss
    assert not torch.allclose(kl, result.loss.detach())  # another objective, not the kl under a new name


@pytest.mark.parametrize("step, chunk_tokens, top_k", [(0, 4096, 3), (2, 16, 1), (1, 1, 25)])
def test_hass_loss_equals_its_textbook_value_and_gradient(step, chunk_tokens, top_k):
    """--objective hass (HASS, ICLR 2025): the kl plus w · the cross-entropy over the target's own top-K draft tokens,
    −Σ_{v ∈ top-K(p)} p_v log q_v; computed as one soft cross-entropy to a reweighted teacher (loss.harmonized), its
    value and gradient equal the written-out sum's, chunked or not; K as large as the draft vocabulary is (1 + w) · kl."""
    gen = torch.Generator().manual_seed(11 + step)
    batch, tokens, width, vocab = 3, 12, 16, 40
    draft_ids = torch.sort(torch.randperm(vocab, generator=gen)[:25]).values
    head, final = torch.randn(vocab, width, generator=gen), torch.randn(batch, tokens, width, generator=gen)
    signal = target_signal(final, head, draft_ids, chunk_tokens=5)
    loss_mask = (torch.rand(batch, tokens, generator=gen) > 0.3).to(torch.uint8)
    logits = (2 * torch.randn(batch, tokens, len(draft_ids), generator=gen)).requires_grad_()

    kl, _ = textbook(logits, signal, loss_mask, step)
    shift = 1 + step
    weight = ((shift_left(loss_mask, shift + 1) > 0) & shift_left(signal.in_draft, shift, fill=False)).float()
    p = shift_left(signal.probs, shift)
    top = torch.zeros_like(p).scatter_(-1, p.topk(top_k, dim=-1).indices, 1.0)
    extra = -(top * p * F.log_softmax(logits.float(), -1)).sum(-1)
    expected = kl + 0.5 * (extra * weight).sum() / weight.sum().clamp(min=1.0)
    expected.backward()
    want_grad, logits.grad = logits.grad, None

    from eyas.families.eagle3.loss import harmonized

    plain_argmax = signal.argmax.clone()
    result = step_loss(logits, harmonized(signal, top_k, 0.5), loss_mask, step, chunk_tokens=chunk_tokens,
                       objective="hass")
    result.loss.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad, want_grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(signal.argmax, plain_argmax)  # the counts still compare with the target's own top choice
    if top_k == len(draft_ids):
        torch.testing.assert_close(result.loss, 1.5 * kl, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(result.loss.detach(), 1.5 * kl.detach())
    with pytest.raises(ValueError, match="harmonized"):
        step_loss(logits, target_signal(final, head, draft_ids), loss_mask, step, objective="hass")
