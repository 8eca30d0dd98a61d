"""A right-padded batch gives every sequence the same per-token states as capturing it alone."""

import pytest
import torch

import zoo
from eyas.target import capture_hidden_states, discover_layout


@pytest.mark.parametrize("arch", sorted(zoo.ARCHITECTURES))
def test_padded_batch_equals_each_sequence_alone(arch):
    model = zoo.ARCHITECTURES[arch][0]()
    layout = discover_layout(model)
    gen = torch.Generator().manual_seed(4)
    sequences = [torch.randint(1, 240, (n,), generator=gen) for n in (11, 4, 17)]
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    batch = capture_hidden_states(model, layout, input_ids, attention_mask=mask)
    assert batch.lengths.tolist() == [11, 4, 17]
    for row, seq in enumerate(sequences):
        alone = capture_hidden_states(model, layout, seq.unsqueeze(0))
        aux, final = batch.sequence(row)
        # Same math, other batch shapes: equal up to fp32 summation order.
        torch.testing.assert_close(aux, alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, alone.final[0], rtol=1e-5, atol=1e-5)
