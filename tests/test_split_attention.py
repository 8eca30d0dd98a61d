"""The "split" TTT attention (eyas.families.eagle3.split_attention): a causal flash kernel over the real keys and the own keys
merged by log-sum-exp must give the reference's outputs *and gradients* — its backward is written by hand."""

import pytest
import torch

from eyas.families.eagle3.memory import saved_storages
from eyas.families.eagle3.split_attention import attend_split
from eyas.families.eagle3.ttt import attend_real_and_own, ttt_steps
from test_drafter_consistency import random_drafter, tiny_config


def _inputs(own: int, tokens: int, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 3, tokens, 8)
    make = lambda: (torch.randn(shape, generator=gen) * 2).to(dtype).requires_grad_()  # noqa: E731 - sharper softmax
    return make(), make(), make(), [make() for _ in range(own)], [make() for _ in range(own)]


def _unroll_batch(config, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of random target states and token ids, ``tokens`` long, for a TTT unroll."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, tokens, config.aux_width, generator=gen),
            torch.randint(0, config.vocab_size, (2, tokens), generator=gen))


@pytest.mark.parametrize("own,tokens", [(1, 5), (3, 13), (6, 33)])
def test_outputs_and_gradients_equal_the_scores_reference(own, tokens):
    """In float64, so that any difference beyond rounding is a mistake, not the two paths' fp32 summation orders."""
    q, real_k, real_v, own_k, own_v = _inputs(own, tokens, torch.float64)
    future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    tensors = [q, real_k, real_v, *own_k, *own_v]
    weight = torch.randn(2, 3, tokens, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    results = []
    for attend in (lambda: attend_real_and_own(q, real_k, real_v, own_k, own_v, future),
                   lambda: attend_split(q, real_k, real_v, own_k, own_v)):
        out = attend()
        grads = torch.autograd.grad((out * weight).sum(), tensors)
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["q", "real_k", "real_v"] + [f"own_k{j}" for j in range(own)] + [f"own_v{j}" for j in range(own)],
                          got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_backward_without_the_merged_correction_fails_the_same_comparison(monkeypatch):
    """The test above has teeth: handing the flash backward the real keys' own log-sum-exp (not the merged one)
    — a plausible mistake — gives gradients the comparison rejects."""
    import eyas.families.eagle3.split_attention as split

    q, real_k, real_v, own_k, own_v = _inputs(3, 13)
    future = torch.ones(13, 13, dtype=torch.bool).triu(1)
    want = torch.autograd.grad(attend_real_and_own(q, real_k, real_v, own_k, own_v, future).sum(), q)[0]
    forward = split._flash_forward

    def wrong_backward(grad, q_, k_, v_, out, lse, extra, scale):
        real_out, real_lse, _ = forward(q_, k_, v_, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q_, k_, v_, real_out, real_lse, 0.0, True, scale=scale)

    monkeypatch.setattr(split, "_flash_backward", wrong_backward)
    got = torch.autograd.grad(attend_split(q, real_k, real_v, own_k, own_v).sum(), q)[0]
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-4)


def test_a_whole_ttt_unroll_trains_the_same_with_split_attention():
    """Every parameter's gradient of a 5-step unroll over right-padded rows, split against scores (fp32)."""
    config = tiny_config()
    aux, ids = _unroll_batch(config, 17, seed=4)
    grads = {}
    for attention in ("scores", "split"):
        drafter = random_drafter(config).train()
        loss = sum((logits.float().log_softmax(-1)[..., :7].sum() * (0.8 ** k))
                   for k, logits in enumerate(ttt_steps(drafter, aux, ids, 5, attention=attention)))
        loss.backward()
        grads[attention] = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    assert grads["scores"].keys() == grads["split"].keys() and len(grads["split"]) > 5
    for name, want in grads["scores"].items():
        torch.testing.assert_close(grads["split"][name], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_stays_close_to_fp32():
    q, real_k, real_v, own_k, own_v = _inputs(4, 21)
    future = torch.ones(21, 21, dtype=torch.bool).triu(1)
    want = attend_real_and_own(q, real_k, real_v, own_k, own_v, future)
    low = [t.detach().bfloat16() for t in (q, real_k, real_v)]
    got = attend_split(*low, [t.detach().bfloat16() for t in own_k], [t.detach().bfloat16() for t in own_v])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.detach(), rtol=0.05, atol=0.05)


def test_an_unknown_attention_name_is_refused():
    config = tiny_config()
    with pytest.raises(ValueError, match="one of scores, concat, split"):
        next(ttt_steps(random_drafter(config), torch.zeros(1, 4, config.aux_width), torch.zeros(1, 4, dtype=torch.long),
                       2, attention="dense"))


def test_the_unroll_keeps_less_for_backward_with_split_than_with_concat():
    """"split" keeps no [real ‖ own] key copies (concat's (k + 1)·T keys per step) and no stacked own keys: the
    memory of the TTT unroll, counted as the unique storages autograd saves."""
    config = tiny_config()
    aux, ids = _unroll_batch(config, 96, seed=5)
    kept = {}
    for attention in ("concat", "split"):
        drafter = random_drafter(config).train()
        with saved_storages(drafter) as saved:
            logits = list(ttt_steps(drafter, aux, ids, 7, attention=attention))  # alive while counted
        kept[attention] = sum(saved.values())
        del logits
    assert kept["split"] < 0.8 * kept["concat"], kept


def test_the_memory_estimate_of_a_ttt_unroll_runs_and_grows_with_its_steps():
    """benchmarks/kimi_estimate.py's count of what a TTT unroll keeps for backward (on the meta device: no memory
    used): it builds the loss's inputs as the trainer does, so it breaks when they change (it did: TargetSignal.mass)."""
    from eyas.families.eagle3.memory import ttt_saved_bytes
    from test_drafter_consistency import tiny_config

    config = tiny_config()
    two, four = ttt_saved_bytes(config, 2, 64, 2), ttt_saved_bytes(config, 2, 64, 4)
    assert 0 < two < four


@pytest.mark.parametrize("layout", [{}, {"fc_norm": True, "norm_output": True}, {"hidden_size": 32, "num_attention_heads": 2,
                                                                              "num_key_value_heads": 1}],
                         ids=["eagle3", "eagle3.1", "narrower-drafter"])
def test_under_the_trainings_autocast_every_layout_hands_the_kernel_one_half_precision(layout, monkeypatch):
    """On a GPU the drafter trains with fp32 master weights under bf16 autocast, and the flash kernel (forward under
    autocast, backward outside it) takes fp16 / bf16 only: every step's q, k, v, for every drafter layout, must reach it
    in bf16 — EAGLE-3.1's fp32 norm output once reached it as fp32 and failed only on the GPU (2026-12-07)."""
    from eyas.families.eagle3 import split_attention

    seen = []
    kernel = split_attention._flash_forward

    def recording(q, k, v, scale):
        seen.append({q.dtype, k.dtype, v.dtype})
        return kernel(q, k, v, scale)

    monkeypatch.setattr(split_attention, "_flash_forward", recording)
    config = tiny_config(**layout)
    drafter = random_drafter(config)
    gen = torch.Generator().manual_seed(4)
    aux = torch.randn(2, 9, config.aux_width, generator=gen)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total = sum(logits.float().square().mean() for logits in ttt_steps(drafter, aux, ids, 4, attention="split"))
    total.backward()
    assert len(seen) == 3 and all(dtypes == {torch.bfloat16} for dtypes in seen), seen  # steps 1 … 3
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.dtype == torch.float32
