"""A DATA_DIR of random token ids, for rehearsals at scale where no real conversations are needed (benchmarks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eyas.data.samples import Sample, read_samples, write_samples
from eyas.data.vocab import VOCAB_FILE, build_draft_vocab, count_masked_tokens, save_vocab
from eyas.manifest import write_manifest


def write_random_data_dir(directory, vocab_size: int, draft_vocab_size: int, samples: dict[str, int],
                          lengths: tuple[int, int], seed: int = 0) -> Path:
    """``samples[split]`` samples per split, lengths uniform in ``lengths`` (inclusive), ids Zipf-distributed over
    ``vocab_size`` (a few frequent tokens, a long tail, as in text), the second half of each sample masked for loss;
    the draft vocabulary from those counts; a prepare-stage manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, count in samples.items():
        rows = []
        for i in range(count):
            length = int(rng.integers(lengths[0], lengths[1] + 1))
            ids = (rng.zipf(1.2, size=length) % (vocab_size - 3) + 3).astype(np.int32)  # 0..2: pad, bos, eos
            mask = (np.arange(length) >= length // 2).astype(np.uint8)
            rows.append(Sample(f"{split}-{i:06d}", ids, mask))
        write_samples(rows, directory / f"{split}.parquet")
    first = next(iter(samples))
    counts = count_masked_tokens(((s.input_ids, s.loss_mask) for s in read_samples(directory / f"{first}.parquet")),
                                 vocab_size)
    save_vocab(build_draft_vocab(counts, draft_vocab_size), directory / VOCAB_FILE)
    options = {"synthetic": "random ids", "vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size,
               "samples": samples, "lengths": list(lengths), "seed": seed}
    write_manifest(directory, "prepare", options, [], [*(f"{split}.parquet" for split in samples), VOCAB_FILE])
    return directory
