"""Draft vocabulary: top-Vd masked ids (ties → lower id), ascending, stored as d2t offsets and a t2d mask."""

import numpy as np
import torch

from eyas.data.vocab import build_draft_vocab, count_masked_tokens, load_vocab, save_vocab


def test_draft_vocab_is_top_vd_by_masked_frequency_sorted_ascending(tmp_path):
    rng = np.random.default_rng(0)
    vocab_size, vd = 500, 64
    samples = []
    for _ in range(40):
        ids = rng.zipf(1.3, size=300) % vocab_size
        mask = rng.integers(0, 2, size=300)
        samples.append((ids, mask))
    counts = count_masked_tokens(samples, vocab_size)
    # Counted over masked positions only.
    expected_counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        for token, bit in zip(ids, mask, strict=True):
            expected_counts[token] += bit
    assert np.array_equal(counts, expected_counts)

    vocab = build_draft_vocab(counts, vd)
    assert vocab.t2d.dtype == torch.bool and vocab.d2t.dtype == torch.int64
    assert int(vocab.t2d.sum()) == vd == len(vocab.d2t)
    draft_ids = torch.arange(vd) + vocab.d2t
    assert bool((draft_ids[1:] > draft_ids[:-1]).all()), "strictly increasing"
    ranked = sorted(range(vocab_size), key=lambda i: (-counts[i], i))[:vd]  # ties by lower id
    assert draft_ids.tolist() == sorted(ranked)
    assert torch.equal(vocab.t2d.nonzero().flatten(), draft_ids)

    save_vocab(vocab, tmp_path / "vocab.safetensors")
    again = load_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(again.d2t, vocab.d2t) and torch.equal(again.t2d, vocab.t2d) and torch.equal(again.counts, vocab.counts)


def test_ties_go_to_the_lower_id_including_unseen_tokens():
    counts = np.array([0, 5, 2, 5, 0, 2, 0])
    assert build_draft_vocab(counts, 3).draft_ids.tolist() == [1, 2, 3]
    assert build_draft_vocab(counts, 5).draft_ids.tolist() == [0, 1, 2, 3, 5]


def test_identity_when_draft_vocab_is_not_smaller():
    vocab = build_draft_vocab(np.array([3, 0, 1, 0]), 10)
    assert vocab.d2t.tolist() == [0, 0, 0, 0] and bool(vocab.t2d.all())
