"""The DFlash block drafter (eyas.families.dflash): training computes what drafting computes, block by block; a block
sees only the context before its anchor and itself; the loss is the slots' weighted cross-entropy; the published
layer-id rule in eyas' meaning."""

import re

import pytest
import torch
from torch import nn

from eyas.families.dflash.config import DFlashConfig, default_dflash_layer_ids, dflash_ids
from eyas.families.dflash.model import (
    DFlashDrafter,
    accepted_runs,
    dflash_loss,
    propose,
    sample_anchors,
    training_mask,
)

VOCAB, TARGET_HIDDEN, BLOCK, MASK = 97, 24, 4, 96


def build(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=32, target_hidden_size=TARGET_HIDDEN, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                          vocab_size=VOCAB, block_size=BLOCK, mask_token_id=MASK, layer_ids=[1, 3, 5])
    drafter = DFlashDrafter(config).double()
    for p in drafter.parameters():  # away from the identity init, so every piece matters
        nn.init.normal_(p, std=0.3)
    embed = nn.Embedding(VOCAB, 32).double().requires_grad_(False)
    lm_head = torch.randn(VOCAB, 32, dtype=torch.float64)
    return drafter, embed, lm_head


def sequence(length: int = 20, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(length, 3 * TARGET_HIDDEN, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, VOCAB - 1, (length,), generator=generator)
    loss_mask = (torch.arange(length) >= 5).long()
    return features, ids, loss_mask


def block_logits_by_drafting(drafter, embed, lm_head, features, ids, anchor):
    """One block as drafting runs it: the context cache of positions < anchor, then the block alone."""
    context = drafter.context(features[None, :anchor])
    cache = drafter.context_kv(context, torch.arange(anchor)[None])
    tokens = torch.tensor([[ids[anchor].item()] + [MASK] * (BLOCK - 1)])
    hidden = drafter.block_hidden(embed(tokens), anchor + torch.arange(BLOCK)[None], cache, None)
    return hidden[0, 1:] @ lm_head.T


def block_logits_by_training(drafter, embed, lm_head, features, ids, anchors):
    """Every block in one forward over the whole sequence, as dflash_loss runs it: [n, B − 1, V]."""
    context = drafter.context(features[None])
    cache = drafter.context_kv(context, torch.arange(len(ids))[None])
    tokens = torch.cat([torch.tensor([ids[a].item()] + [MASK] * (BLOCK - 1)) for a in anchors])
    positions = (anchors[:, None] + torch.arange(BLOCK)).flatten()
    hidden = drafter.block_hidden(embed(tokens)[None], positions[None], cache, training_mask(anchors, len(ids), BLOCK))
    return hidden[0].view(len(anchors), BLOCK, -1)[:, 1:] @ lm_head.T


def test_training_blocks_equal_drafting_blocks():
    drafter, embed, lm_head = build()
    features, ids, loss_mask = sequence()
    anchors = torch.tensor([2, 7, 11, 16])
    config = drafter.config
    trained = block_logits_by_training(drafter, embed, lm_head, features, ids, anchors)
    for j, anchor in enumerate(anchors.tolist()):
        drafted = block_logits_by_drafting(drafter, embed, lm_head, features, ids, anchor)
        torch.testing.assert_close(trained[j], drafted, rtol=1e-10, atol=1e-10)
        greedy = propose(drafter, drafter.context_kv(drafter.context(features[None, :anchor]), torch.arange(anchor)[None]),
                         ids[anchor].item(), anchor, embed, lm_head)
        assert greedy.tolist() == drafted.argmax(-1).tolist()
    assert config.block_size == BLOCK


def test_a_block_sees_only_the_context_before_its_anchor_and_itself():
    drafter, embed, lm_head = build()
    features, ids, _ = sequence()
    anchors = torch.tensor([4, 9, 14])
    before = block_logits_by_training(drafter, embed, lm_head, features, ids, anchors)[1]
    later, other = features.clone(), ids.clone()
    later[9:] += 1.0  # the anchor's own states and everything after: not known when the block is drafted
    other[4], other[14] = (other[4] + 1) % MASK, (other[14] + 1) % MASK  # the other blocks' anchor tokens
    torch.testing.assert_close(block_logits_by_training(drafter, embed, lm_head, later, other, anchors)[1], before)
    earlier = features.clone()
    earlier[8] += 1.0  # the last context position before the anchor: it matters
    assert not torch.allclose(block_logits_by_training(drafter, embed, lm_head, earlier, ids, anchors)[1], before)
    mask = training_mask(torch.tensor([3, 8]), 12, BLOCK)
    assert mask.shape == (2 * BLOCK, 12 + 2 * BLOCK)
    assert mask[0, :3].all() and not mask[0, 3:12].any()  # block 0: context 0..2 only
    assert mask[BLOCK, :8].all() and not mask[BLOCK, 8:12].any()
    assert mask[:BLOCK, 12:12 + BLOCK].all() and not mask[:BLOCK, 12 + BLOCK:].any()  # its own rows, not block 1's
    assert mask[BLOCK:, 12 + BLOCK:].all() and not mask[BLOCK:, 12:12 + BLOCK].any()


def test_the_loss_is_the_slots_weighted_cross_entropy_and_trains_only_the_drafter():
    drafter, embed, lm_head = build()
    features, ids, loss_mask = sequence()
    anchors = torch.tensor([4, 9, 15])
    gamma = 2.0
    result = dflash_loss(drafter, features, ids, loss_mask, anchors, embed, lm_head, gamma=gamma)
    total, weight = 0.0, 0.0
    for anchor in anchors.tolist():
        logits = block_logits_by_drafting(drafter, embed, lm_head, features, ids, anchor)
        for k in range(1, BLOCK):
            w = loss_mask[anchor + k].item() * torch.exp(torch.tensor(-(k - 1) / gamma, dtype=torch.float64))
            total += w * torch.nn.functional.cross_entropy(logits[k - 1][None], ids[anchor + k][None])
            weight += w
    torch.testing.assert_close(result.loss.double(), total / weight, rtol=1e-5, atol=1e-6)  # logits in fp32 for the loss
    assert result.slots == sum(int(loss_mask[a + k]) for a in anchors.tolist() for k in range(1, BLOCK))
    runs = []  # simulated τ: what the reference loop's verification would accept, block by block
    for anchor in anchors.tolist():
        drafts = block_logits_by_drafting(drafter, embed, lm_head, features, ids, anchor).argmax(-1).tolist()
        n = 0
        while n < BLOCK - 1 and drafts[n] == ids[anchor + 1 + n].item():
            n += 1
        runs.append(n)
    assert result.tau == pytest.approx(1 + sum(runs) / len(runs))
    result.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert embed.weight.grad is None and not lm_head.requires_grad


def test_anchors_have_a_trained_next_token_and_a_whole_block():
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    anchors = sample_anchors(loss_mask, BLOCK, 100)
    assert anchors.tolist() == [a for a in range(1, 12 - BLOCK + 1) if loss_mask[a + 1]]
    few = sample_anchors(loss_mask, BLOCK, 2, torch.Generator().manual_seed(0))
    assert len(few) == 2 and set(few.tolist()) <= set(anchors.tolist()) and few.tolist() == sorted(few.tolist())
    assert sample_anchors(torch.ones(3, dtype=torch.long), BLOCK, 10).numel() == 0  # too short for one block


@pytest.mark.parametrize("target_layers, draft_layers, published", [(36, 5, [1, 9, 17, 25, 33]), (30, 1, [15]),
                                                                     (61, 3, [1, 30, 58])])
def test_default_layer_ids_are_the_published_rule_in_eyas_meaning(target_layers, draft_layers, published):
    ids = default_dflash_layer_ids(target_layers, draft_layers)
    assert dflash_ids(ids) == published  # DFlash counts layer outputs: eyas id = output id + 1
    assert ids == [i + 1 for i in published]


def test_parameter_names_are_the_checkpoint_names_vllm_loads():
    """vLLM 0.32's DFlashQwen3 loader (qwen3_dflash.py load_weights): no `model.` prefix, Qwen3 layer names, no
    embedding or lm_head (the target's are shared), no mask_hidden."""
    drafter, _, _ = build(layers=2)
    layer = {"input_layernorm.weight": [32], "post_attention_layernorm.weight": [32],
             "self_attn.q_proj.weight": [32, 32], "self_attn.k_proj.weight": [16, 32], "self_attn.v_proj.weight": [16, 32],
             "self_attn.o_proj.weight": [32, 32], "self_attn.q_norm.weight": [8], "self_attn.k_norm.weight": [8],
             "mlp.gate_proj.weight": [48, 32], "mlp.up_proj.weight": [48, 32], "mlp.down_proj.weight": [32, 48]}
    expected = {"fc.weight": [32, 3 * TARGET_HIDDEN], "hidden_norm.weight": [32], "norm.weight": [32],
                **{f"layers.{i}.{name}": shape for i in range(2) for name, shape in layer.items()}}
    assert {name: list(t.shape) for name, t in drafter.state_dict().items()} == expected


def test_export_writes_what_vllm_reads_and_reads_back_the_same_drafter(tmp_path):
    import json

    from eyas.families.dflash.export import load_dflash_dir, write_dflash_dir

    drafter, embed, lm_head = build(layers=2)
    write_dflash_dir(tmp_path / "draft", drafter, "fp32", max_position_embeddings=2048)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 2, 4]}  # outputs of layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and "eagle_config" not in config
    assert config["block_size"] == BLOCK and config["num_hidden_layers"] == 2
    back = load_dflash_dir(tmp_path / "draft", torch.float64)
    features, ids, _ = sequence()
    torch.testing.assert_close(block_logits_by_drafting(back, embed, lm_head, features, ids, 9),
                               block_logits_by_drafting(drafter, embed, lm_head, features, ids, 9), rtol=1e-5, atol=1e-5)  # fp32 on disk
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="not a DFlash drafter"):
        load_dflash_dir(tmp_path / "draft")


def test_accepted_runs_stop_at_the_first_miss():
    right = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert accepted_runs(right).tolist() == [2, 0, 4]


def test_eyas_check_holds_a_dflash_directory_to_what_vllm_loads(tmp_path):
    import json

    from eyas.export.check import check_draft_dir
    from eyas.export.fit import TargetSizes
    from eyas.families.dflash.export import write_dflash_dir

    drafter, _, _ = build(layers=2)
    write_dflash_dir(tmp_path / "draft", drafter, "bf16", max_position_embeddings=2048)
    assert check_draft_dir(tmp_path / "draft").ok
    fits = TargetSizes("llama", 8, TARGET_HIDDEN, VOCAB)
    assert check_draft_dir(tmp_path / "draft", fits).ok
    other = check_draft_dir(tmp_path / "draft", TargetSizes("llama", 4, TARGET_HIDDEN * 2, VOCAB))
    assert any("target_hidden_size 24" in e for e in other.errors) and any("layer ids [5]" in e for e in other.errors)
    path = tmp_path / "draft" / "config.json"
    good = json.loads(path.read_text())
    for change, says in [(lambda c: c.update(eagle_config={"use_aux_hidden_state": True}), "has eagle_config"),
                         (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 5]), "name different states"),
                         (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), "outside the vocabulary"),
                         (lambda c: c.update(num_hidden_layers=3), "not the DFlash drafter its config describes")]:
        config = json.loads(json.dumps(good))
        change(config)
        path.write_text(json.dumps(config))
        errors = check_draft_dir(tmp_path / "draft").errors
        assert any(says in e for e in errors), (says, errors)


@pytest.mark.parametrize("change, says", [
    (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), f"mask_token_id {VOCAB} is outside the vocabulary"),
    (lambda c: c["dflash_config"].update(mask_token_id="7"), "mask_token_id '7' is outside the vocabulary"),
    (lambda c: c.update(block_size="x"), "block_size is 'x': a DFlash drafter needs a whole number"),
    (lambda c: c.update(rms_norm_eps=-1), "rms_norm_eps is -1: a DFlash drafter needs a positive number"),
    (lambda c: c.update(dflash_config=[1]), "dflash_config is [1]: an object"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids") and c["dflash_config"].update(target_layer_ids="0,2"),
     "needs its target layer ids"),
])
def test_a_hand_edited_dflash_config_is_one_line_naming_the_field_wherever_it_is_read(tmp_path, change, says):
    """Loading a DFlash directory (eyas bench, eyas generate) reads config.json by the rule eyas check does: a field
    of the wrong kind or out of range is one line naming it, not a traceback or an IndexError in the first round."""
    import json

    from eyas.errors import EyasError
    from eyas.export.check import check_draft_dir
    from eyas.families.dflash.export import load_dflash_dir, write_dflash_dir

    drafter, _, _ = build(layers=2)
    write_dflash_dir(tmp_path / "draft", drafter, "bf16", max_position_embeddings=2048)
    path = tmp_path / "draft" / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    with pytest.raises(EyasError, match=re.escape(says)) as caught:
        load_dflash_dir(tmp_path / "draft")
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert any(says in e for e in check_draft_dir(tmp_path / "draft").errors)


def test_coverage_passes_add_up_to_one_forward_over_every_block():
    """A coverage above one runs as passes of width / B blocks (each its own forward and backward): the loss, each
    slot's share, the counts and every gradient equal one forward over all the blocks at once."""
    import contextlib
    from types import SimpleNamespace

    from eyas.families.dflash.model import block_anchors, block_loss, slot_weights, teacher_tokens
    from eyas.families.dflash.objective import anchor_generator, block_micro_batch, blocks_per_row, score_blocks

    drafter, embed, lm_head = build()
    rows, width = 2, 40
    generator = torch.Generator().manual_seed(3)
    batch = SimpleNamespace(aux=torch.randn(rows, width, 3 * TARGET_HIDDEN, generator=generator, dtype=torch.float64),
                            final=torch.randn(rows, width, 32, generator=generator, dtype=torch.float64),
                            input_ids=torch.randint(0, VOCAB - 1, (rows, width), generator=generator),
                            loss_mask=(torch.arange(width) >= 6).long().expand(rows, width).clone(),
                            valid=torch.ones(rows, width, dtype=torch.bool), tokens=rows * width)
    batch.valid[1, 33:] = False  # a shorter second row: its last places hold no whole block
    batch.loss_mask[1, 33:] = 0
    options = SimpleNamespace(block_coverage=3.0, slot_decay=2.0, grad_accum=1)
    count = blocks_per_row(width, BLOCK, 3.0)
    assert count == 3 * blocks_per_row(width, BLOCK, 1.0)

    anchors, usable = block_anchors(batch.loss_mask, batch.valid, BLOCK, count, anchor_generator(torch.device("cpu"), 7))
    whole = block_loss(drafter, batch.aux, batch.input_ids, teacher_tokens(batch.final, lm_head), batch.loss_mask > 0,
                       anchors, usable, embed.weight, lm_head, slot_weights(BLOCK, 2.0))
    whole.loss.backward()
    expected = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()

    parts = list(score_blocks(drafter, batch, lm_head, embed.weight, options, anchor_generator(torch.device("cpu"), 7)))
    assert len(parts) == 3
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss)
    for field in ("shares", "correct", "counted", "accepted", "blocks", "depth_counts"):
        torch.testing.assert_close(sum(getattr(p, field) for p in parts), getattr(whole, field))
    drafter.zero_grad()
    tallies = tuple(torch.zeros(BLOCK - 1) for _ in range(3))
    assert block_micro_batch(drafter, batch, lm_head, embed.weight, options, contextlib.nullcontext, tallies, 7) == 80
    torch.testing.assert_close(tallies[0], whole.shares)
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)
