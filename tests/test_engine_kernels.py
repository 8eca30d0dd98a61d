"""The engine's Triton kernels, run here by Triton's CPU interpreter (top-k, split-cache attention), and
the drafter scores the top-k yields."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eyas.engine.topk import largest
from test_engine_greedy import runners
from zoo import ARCHITECTURES

SRC = Path(__file__).resolve().parents[1] / "src"

# Each check runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined.
TOP_K_CHECK = textwrap.dedent("""
    import torch
    from eyas.engine.topk import _top_k_triton

    gen = torch.Generator().manual_seed(0)
    for rows, n, k, dtype in [(3, 2500, 8, torch.float32), (2, 3000, 1, torch.bfloat16), (1, 64, 8, torch.float32),
                              (4, 100, 10, torch.bfloat16), (2, 7, 7, torch.float32), (1, 1025, 16, torch.float32)]:
        x = torch.randn(rows, n, generator=gen).to(dtype)
        values, indices = _top_k_triton(x, k)
        expected = x.float().topk(k, dim=-1).values
        assert values.dtype == dtype and indices.dtype == torch.int64, (values.dtype, indices.dtype)
        assert torch.equal(values.float(), expected), (rows, n, k, dtype)
        assert torch.equal(x.gather(1, indices).float(), expected), (rows, n, k, dtype)
        tied = values[:, 1:] == values[:, :-1]
        assert bool(((indices[:, 1:] > indices[:, :-1]) | ~tied).all()), "equal values must come in index order"
    # ties across blocks, a row of -inf but one entry, and k = the whole row
    x = torch.zeros(3, 3000)
    x[0, 2500] = 1.0
    x[1] = float("-inf")
    x[1, 2999] = 3.0
    x[2, :4] = torch.tensor([1.0, 2.0, 2.0, 0.5])
    values, indices = _top_k_triton(x, 4)
    assert indices.tolist() == [[2500, 0, 1, 2], [2999, 0, 1, 2], [1, 2, 0, 3]], indices.tolist()
    assert values[1].tolist() == [3.0] + [float("-inf")] * 3
    print("kernels ok")
""")


# The interpreter's bf16 matmul is broken (Triton 3.9), so the low-precision path is checked in fp16.
ATTENTION_CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    import eyas.engine.attention as kernels
    from eyas.engine.attention import attend

    gen = torch.Generator().manual_seed(0)
    # the shipped tiling (tiles of 64 rows, merges of 16, up to 192 rows), then one tile and one merge of ≤ 128;
    # with each, the token counts of a 3-query-head group left to SDPA: 70 tokens are 210 rows (four tiles of
    # 64, or two of 128), 61 tokens 183 rows (three tiles of 64, or two of 128)
    shipped = (kernels.TILE_ROWS, kernels.MERGE_ROWS, kernels.MAX_ROWS)
    assert shipped == (64, 16, 192), shipped
    for (kernels.TILE_ROWS, kernels.MERGE_ROWS, kernels.MAX_ROWS), to_sdpa in [(shipped, {70}), ((128, 128, 128), {61, 70})]:
      for heads, kv_heads, n, slots, dim, dtype, tolerance in [
            (9, 3, 1, 200, 64, torch.float32, 1e-5), (9, 3, 6, 130, 64, torch.float32, 1e-5),
            (4, 4, 33, 200, 32, torch.float32, 1e-5), (8, 2, 5, 64, 128, torch.float32, 1e-5),
            (9, 3, 61, 300, 64, torch.float32, 1e-5), (9, 3, 33, 660, 64, torch.float16, 2e-3),
            (9, 3, 70, 100, 64, torch.float32, 1e-5)]:
          q = torch.randn(1, heads, n, dim, generator=gen).to(dtype)
          keys = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
          values = torch.randn(1, kv_heads, slots, dim, generator=gen).to(dtype)
          # a committed prefix, then a tree block (each token sees itself and some earlier ones), then unused slots
          length = slots - n - 3
          visible = torch.zeros(n, slots, dtype=torch.bool)
          visible[:, :length] = True
          visible[:, length:length + n] = (torch.rand(n, n, generator=gen) < 0.4).tril() | torch.eye(n, dtype=torch.bool)
          mask = torch.zeros(n, slots, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]
          out = attend(q, keys, values, mask, dim ** -0.5)
          if heads // kv_heads == 3 and n in to_sdpa:
              assert out is None, f"past MAX_ROWS query rows attention is left to SDPA ({n} tokens)"
              continue
          assert out is not None, (heads, kv_heads, n, kernels.TILE_ROWS)
          group = heads // kv_heads
          expected = F.scaled_dot_product_attention(q.float(), keys.repeat_interleave(group, 1).float(),
                                                    values.repeat_interleave(group, 1).float(), attn_mask=visible,
                                                    scale=dim ** -0.5).transpose(1, 2).reshape(1, n, heads * dim)
          assert out.shape == expected.shape and out.dtype == dtype, (out.shape, out.dtype)
          error = (out.float() - expected).abs().max().item()
          assert error < tolerance, (heads, kv_heads, n, slots, dim, dtype, error)
    # bounded by the filled slots: keys, values and mask past them are never read (NaN there, and a mask that
    # would show them), a single filled block among eleven, the cache's last slot, a filled length on a block edge
    kernels.TILE_ROWS, kernels.MERGE_ROWS, kernels.MAX_ROWS = shipped
    for heads, kv_heads, n, slots, filled, dtype, tolerance in [
            (9, 3, 6, 660, 200, torch.float32, 1e-5), (9, 3, 1, 660, 1, torch.float32, 1e-5),
            (8, 2, 33, 300, 300, torch.float32, 1e-5), (9, 3, 5, 257, 128, torch.float16, 2e-3)]:
        q = torch.randn(1, heads, n, 64, generator=gen).to(dtype)
        keys = torch.randn(1, kv_heads, slots, 64, generator=gen).to(dtype)
        values = torch.randn(1, kv_heads, slots, 64, generator=gen).to(dtype)
        keys[:, :, filled:] = float("nan")
        values[:, :, filled:] = float("nan")
        length = filled - n
        visible = torch.zeros(n, slots, dtype=torch.bool)
        visible[:, :length] = True
        visible[:, length:filled] = torch.ones(n, n, dtype=torch.bool).tril()
        shown = visible.clone()
        shown[:, filled:] = True
        mask = torch.zeros(n, slots, dtype=dtype).masked_fill(~shown, torch.finfo(dtype).min)[None, None]
        out = attend(q, keys, values, mask, 0.125, torch.tensor([filled]))
        group = heads // kv_heads
        expected = F.scaled_dot_product_attention(
            q.float(), keys[:, :, :filled].repeat_interleave(group, 1).float(),
            values[:, :, :filled].repeat_interleave(group, 1).float(), attn_mask=visible[:, :filled],
            scale=0.125).transpose(1, 2).reshape(1, n, heads * 64)
        error = (out.float() - expected).abs().max().item()
        assert error < tolerance, ("filled", heads, kv_heads, n, slots, filled, dtype, error)
    # where the kernels do not apply: the caller runs SDPA
    q = torch.randn(1, 8, 100, 64)
    assert attend(q, torch.randn(1, 1, 150, 64), torch.randn(1, 1, 150, 64), torch.zeros(1, 1, 100, 150), 0.1) is None
    assert not kernels.kernels_available(torch.device("cpu"))
    print("kernels ok")
""")


# The regeneration's batched one-token attention: every row its own mask (left padding, the row's own length),
# slots a partial number of blocks, the cache a slice of a larger one (its slot stride wider than the slice).
ONE_TOKEN_CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from eyas.engine.grouped_attention import one_token_attention

    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, slots, capacity, dim, dtype, tolerance, shared_mask in [
            (5, 9, 3, 200, 256, 64, torch.float32, 1e-5, False), (3, 8, 2, 64, 64, 128, torch.float32, 1e-5, False),
            (4, 4, 4, 130, 192, 32, torch.float16, 2e-3, False), (2, 16, 1, 70, 128, 64, torch.float32, 1e-5, True)]:
        q = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
        keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(dtype)[:, :, :slots]
        values = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(dtype)[:, :, :slots]
        visible = torch.rand(1 if shared_mask else batch, slots, generator=gen) < 0.7
        visible[:, slots - 1] = True  # a row always sees its own new token
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None, None]
        wide = torch.zeros(mask.shape[0], 1, 1, slots + 40, dtype=dtype)  # masks may be wider than the slots
        wide[..., :slots] = mask
        out = one_token_attention(q, keys, values, wide, dim ** -0.5)
        assert out is not None and out.shape == (batch, 1, heads, dim) and out.dtype == dtype, (None if out is None else out.shape)
        group = heads // kv_heads
        expected = F.scaled_dot_product_attention(
            q.float(), keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float(),
            attn_mask=visible[:, None, None].expand(batch, 1, 1, slots), scale=dim ** -0.5).transpose(1, 2)
        error = (out.float() - expected).abs().max().item()
        assert error < tolerance, (batch, heads, kv_heads, slots, dim, dtype, error)
    # where it does not apply, SDPA runs: two query tokens, 17 query heads per key head, an odd head size, values
    # narrower than keys (MLA)
    assert one_token_attention(torch.randn(1, 9, 1, 64), torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 32),
                               torch.zeros(1, 1, 1, 8), 0.1) is None
    assert one_token_attention(torch.randn(1, 9, 2, 64), torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64),
                               torch.zeros(1, 1, 1, 8), 0.1) is None
    assert one_token_attention(torch.randn(1, 17, 1, 64), torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64),
                               torch.zeros(1, 1, 1, 8), 0.1) is None
    assert one_token_attention(torch.randn(1, 9, 1, 48), torch.randn(1, 3, 8, 48), torch.randn(1, 3, 8, 48),
                               torch.zeros(1, 1, 1, 8), 0.1) is None
    print("kernels ok")
""")


def interpret(check: str) -> None:
    import triton  # noqa: F401 — a test dependency (pyproject): fails loudly where it is missing

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "kernels ok" in result.stdout, result.stderr[-3000:]


def test_the_top_k_kernels_find_the_largest_entries_in_order():
    interpret(TOP_K_CHECK)


def test_the_attention_kernels_equal_sdpa_for_any_mask_and_head_grouping():
    """Grouped query heads (9 over 3 key heads, 8 over 2), one key head per query head, 1 to 61 tokens (1 to
    6 tiles of query rows), head sizes 32 to 128, caches of 1 to 11 blocks with a partial last one, a tree mask;
    bounded by the filled slots (what lies past them never read)."""
    interpret(ATTENTION_CHECK)


def test_the_one_token_attention_kernel_equals_sdpa_for_every_row_and_its_mask():
    """The regeneration's batched decoding step: 1 to 16 query heads per key head, head sizes 32 to 128, every
    row with its own padding mask (or one shared), caches sliced from larger ones, masks wider than the cache."""
    interpret(ONE_TOKEN_CHECK)


def test_largest_is_the_top_k_off_the_gpu_and_refuses_bad_shapes():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    values, indices = largest(x, 6)
    assert torch.equal(values, x.topk(6, dim=-1).values) and torch.equal(x.gather(1, indices), values)
    with pytest.raises(ValueError, match="at least k = 301 columns"):
        largest(x, 301)
    with pytest.raises(ValueError, match="2-D"):
        largest(x[0], 3)


def test_drafter_scores_are_the_log_probabilities_of_its_best_proposals():
    """The drafter normalises only its k best logits (logits − logsumexp): the scores must be exactly the
    log-softmax at the ids it proposes, and those ids its k most probable."""
    model = ARCHITECTURES["llama"][0]()
    _, drafter = runners(model)
    gen = torch.Generator().manual_seed(4)
    aux = torch.randn(1, 5, drafter.drafter.config.aux_width, generator=gen)
    tokens = torch.randint(0, 256, (1, 5), generator=gen)
    for valid in (5, 2):  # the state scored is the last valid one
        last = valid - 1
        prenorm, scores, ids, position, committed = drafter.commit(aux, tokens, torch.arange(5).unsqueeze(0),
                                                                   torch.tensor([0]), torch.tensor([valid]), top_k=4)
        assert int(position) == last and int(committed) == valid
        logprobs = torch.log_softmax(drafter.drafter.logits(prenorm)[0].float(), -1)
        torch.testing.assert_close(scores, logprobs.gather(1, ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(scores, logprobs.topk(4, dim=-1).values, rtol=0, atol=1e-5)
