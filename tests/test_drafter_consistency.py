"""Train/inference consistency: TTT logits at step k equal chained drafting's logits, fp32, ≤ 1e-5 relative.

This pins positions, masks and the hidden recurrence: if training and drafting disagreed anywhere,
the drafter would be trained for a situation the engine never produces.
"""

import pytest
import torch

from eyas.families.eagle3.config import DrafterConfig
from eyas.families.eagle3.model import Eagle3Drafter
from eyas.families.eagle3.ttt import ttt_steps
from reference_drafting import greedy_chain


def tiny_config(**overrides):
    base = dict(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, rms_norm_eps=1e-6, vocab_size=300, draft_vocab_size=120, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, layer_ids=[2, 4, 5])
    return DrafterConfig(**{**base, **overrides})


def random_drafter(config, seed=0):
    torch.manual_seed(seed)
    draft_ids = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    drafter = Eagle3Drafter(config, d2t=draft_ids - torch.arange(config.draft_vocab_size))
    for p in drafter.parameters():  # larger than default init, so the chain is far from uniform
        torch.nn.init.normal_(p, std=0.5 if p.dim() == 1 else 0.2)
    return drafter.eval()


@pytest.mark.parametrize(
    "config",
    [tiny_config(), tiny_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
     tiny_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1),  # narrower than the target
     tiny_config(fc_norm=True, norm_output=True)],  # EAGLE-3.1's norms
    ids=["default-rope", "llama3-rope", "narrower-drafter", "eagle3.1"],
)
@pytest.mark.parametrize("attention", ["scores", "concat", "split"])
def test_ttt_step_k_equals_chained_drafting(config, attention):
    steps = 7
    drafter = random_drafter(config)
    gen = torch.Generator().manual_seed(1)
    batch, prefix = 2, 11
    aux_prefix = torch.randn(batch, prefix, config.aux_width, generator=gen)
    tokens = torch.randint(0, config.vocab_size, (batch, prefix + 1), generator=gen)  # t_0 … t_P
    with torch.no_grad():
        chain_logits, drafted = greedy_chain(drafter, aux_prefix, tokens[:, 1:], steps)
    # The sequence continues with the drafter's own greedy chain; features after the prefix are arbitrary.
    input_ids = torch.cat([tokens, torch.stack(drafted, dim=1)[:, : steps - 1]], dim=1)
    total = input_ids.shape[1]
    aux = torch.cat([aux_prefix, torch.randn(batch, total - prefix, config.aux_width, generator=gen)], dim=1)
    with torch.no_grad():
        ttt_logits = list(ttt_steps(drafter, aux, input_ids, steps, attention=attention))
    position = prefix - 1  # the last real position: where the chain was drafted from
    for k in range(steps):
        expected, got = chain_logits[k], ttt_logits[k][:, position]
        rel = ((got - expected).abs().max() / expected.abs().max()).item()
        assert rel <= 1e-5, f"step {k}: relative difference {rel:.2e}"
    # The steps really differ (hidden, token and position change), so agreement at every step has teeth.
    assert all(not torch.allclose(chain_logits[k], chain_logits[k + 1], rtol=1e-3) for k in range(steps - 1))


@pytest.mark.parametrize("attention", ["scores", "concat", "split"])
def test_padding_and_other_rows_do_not_leak_into_a_sequence(attention):
    config = tiny_config()
    drafter = random_drafter(config)
    gen = torch.Generator().manual_seed(2)
    aux = torch.randn(2, 9, config.aux_width, generator=gen)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    # row 1 is 5 tokens long, right-padded: whatever its padding holds must not reach its first 5 positions
    with torch.no_grad():
        batched = list(ttt_steps(drafter, aux, ids, 3, attention=attention))
        alone = list(ttt_steps(drafter, aux[1:, :5], ids[1:, :5], 3, attention=attention))
    for k in range(3):
        usable = 5 - 1 - k  # positions whose step-k token is still inside the sequence
        torch.testing.assert_close(batched[k][1, :usable], alone[k][0, :usable], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_the_engine_drafts_what_training_trains(eagle31):
    """The engine's drafter — a prompt's states committed eagerly, then each round's accepted states committed
    in a fixed-width pass with only the first ``valid`` counting — drafts the tokens that greedy_chain
    (pinned to the training-time test above) drafts from the whole prefix; with EAGLE-3.1's norms too."""
    from eyas.families.eagle3.runner import DraftRunner
    from eyas.engine.drafting import draft_chain

    config = tiny_config(fc_norm=eagle31, norm_output=eagle31)
    drafter = random_drafter(config)
    runner = DraftRunner(drafter, capacity=64)
    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 16, config.aux_width, generator=gen)
    tokens = torch.randint(0, config.vocab_size, (1, 16), generator=gen)  # the token after each state
    positions = torch.arange(16).unsqueeze(0)
    runner.commit_prompt(aux[:, :4], tokens[:, :4], positions[:, :4])
    start, width = 4, 5  # a round commits up to max depth + 1 states (chains of 4)
    for valid in (1, 3, 1, 3):  # the prompt's last state, then rounds that accepted 2, 0 and 2 drafts
        end = start + valid
        with torch.no_grad():
            drafted = draft_chain(runner, aux[:, start : start + width], tokens[:, start : start + width],
                                  positions[:, start : start + width], torch.tensor([start]), torch.tensor([valid]), 4)
            _, expected = greedy_chain(drafter, aux[:, :end], tokens[:, :end], 4)
        assert drafted.tolist() == torch.stack(expected, dim=1)[0].tolist(), f"after {end} committed states"
        start = end


def test_fused_projections_compute_the_layer_training_computes():
    """The engine's q/k/v and gate/up as one matmul each (a copy of the weights): the layer's output equals
    the separate projections', with grouped key heads; a projection with a bias is never fused."""
    config = tiny_config()
    drafter = random_drafter(config)
    assert config.num_key_value_heads < config.num_attention_heads  # the split widths differ
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, config.hidden_size, generator=gen)
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=gen)
    positions = torch.arange(6).expand(2, 6)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fused = drafter.fused_projections()
    with torch.no_grad():
        torch.testing.assert_close(drafter.layer(hidden, ids, positions, attend, fused),
                                   drafter.layer(hidden, ids, positions, attend), rtol=1e-5, atol=1e-5)
    drafter.midlayer.mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(config.intermediate_size))
    assert drafter.fused_projections() is None
