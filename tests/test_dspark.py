"""The DSpark drafter (eyas.families.dspark): training computes what drafting computes, slot by slot, the Markov head
included; every slot of a block predicts the token after it; the loss is DeepSpec's (cross-entropy against the target's
greedy token and L1 against its distribution, decayed by slot); the checkpoint holds what vLLM's Qwen3DSpark loader
reads."""

import json
import re

import pytest
import torch
from torch import nn

from eyas.families.dspark.config import DSparkConfig
from eyas.families.dspark.model import (
    DSparkDrafter,
    draw_anchors,
    propose,
    slot_weights,
    spark_block_hidden,
    spark_loss,
)

VOCAB, TARGET_HIDDEN, HIDDEN, BLOCK, MASK, RANK = 97, 24, 32, 4, 96, 8


def build(layers: int = 2, seed: int = 0, confidence: bool = False):
    torch.manual_seed(seed)
    config = DSparkConfig(hidden_size=HIDDEN, target_hidden_size=TARGET_HIDDEN, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                          vocab_size=VOCAB, block_size=BLOCK, mask_token_id=MASK, layer_ids=[1, 3, 5], markov_rank=RANK,
                          confidence_head=confidence)
    drafter = DSparkDrafter(config).double()
    for p in drafter.parameters():  # away from the initialisation (markov_w2 starts at zero), so every piece matters
        nn.init.normal_(p, std=0.3)
    embed = nn.Embedding(VOCAB, HIDDEN).double().requires_grad_(False)
    lm_head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    return drafter, embed, lm_head


def sequence(length: int = 20, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(length, 3 * TARGET_HIDDEN, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, VOCAB - 1, (length,), generator=generator)
    final = torch.randn(length, HIDDEN, generator=generator, dtype=torch.float64)
    loss_mask = (torch.arange(length) >= 5).long()
    return features, ids, final, loss_mask


def context_of(drafter, features, anchor):
    return drafter.context_kv(drafter.context(features[None, :anchor]), torch.arange(anchor)[None])


def test_training_slots_equal_drafting_slots_markov_head_included():
    """Every slot's logits in a training forward over the whole sequence (many blocks, teacher-forced Markov inputs)
    equal drafting's from scratch over a cache of the context before the anchor, fed the same previous tokens; and
    drafting's greedy chain feeds its own proposals."""
    drafter, embed, lm_head = build()
    features, ids, _, _ = sequence()
    anchors = torch.tensor([[2, 7, 11, 15]])
    hidden = spark_block_hidden(drafter, features[None], ids[None], anchors, embed.weight)[0]  # [n, B, H]
    for j, anchor in enumerate(anchors[0].tolist()):
        previous = ids[anchor : anchor + BLOCK]
        trained = drafter.slot_logits(hidden[j], lm_head, previous)
        greedy, drafted = propose(drafter, context_of(drafter, features, anchor), ids[anchor].item(), anchor, embed,
                                  lm_head, previous=previous.tolist())
        torch.testing.assert_close(trained, drafted, rtol=1e-10, atol=1e-10)
        chain, rows = propose(drafter, context_of(drafter, features, anchor), ids[anchor].item(), anchor, embed, lm_head)
        assert chain.tolist() == rows.argmax(-1).tolist()
        torch.testing.assert_close(rows[0], drafted[0])  # slot 0 follows the anchor token either way
        for k in range(1, BLOCK):  # each later slot follows the chain's own proposal before it
            own = drafter.slot_logits(hidden[j, k], lm_head, chain[k - 1])
            torch.testing.assert_close(rows[k], own, rtol=1e-10, atol=1e-10)


def test_the_markov_head_makes_a_slot_depend_on_the_token_before_it_and_only_on_it():
    drafter, embed, lm_head = build()
    features, ids, _, _ = sequence()
    cache = context_of(drafter, features, 9)
    _, one = propose(drafter, cache, ids[9].item(), 9, embed, lm_head, previous=[5, 6, 7, 8])
    _, other = propose(drafter, cache, ids[9].item(), 9, embed, lm_head, previous=[5, 6, 70, 8])
    torch.testing.assert_close(one[[0, 1, 3]], other[[0, 1, 3]])
    assert not torch.allclose(one[2], other[2])
    nn.init.zeros_(drafter.markov_head.markov_w2.weight)  # a new drafter's head: the backbone alone
    _, one = propose(drafter, cache, ids[9].item(), 9, embed, lm_head, previous=[5, 6, 7, 8])
    _, other = propose(drafter, cache, ids[9].item(), 9, embed, lm_head, previous=[50, 60, 70, 80])
    torch.testing.assert_close(one, other)


def test_a_block_sees_only_the_context_before_its_anchor_and_itself():
    drafter, embed, lm_head = build()
    features, ids, _, _ = sequence()
    anchors = torch.tensor([[4, 9, 14]])
    before = spark_block_hidden(drafter, features[None], ids[None], anchors, embed.weight)[0, 1]
    later, other = features.clone(), ids.clone()
    later[9:] += 1.0  # the anchor's own states and everything after: unknown when the block is drafted
    other[4], other[14] = (other[4] + 1) % MASK, (other[14] + 1) % MASK  # the other blocks' anchor tokens
    torch.testing.assert_close(spark_block_hidden(drafter, later[None], other[None], anchors, embed.weight)[0, 1], before)
    earlier = features.clone()
    earlier[8] += 1.0
    assert not torch.allclose(spark_block_hidden(drafter, earlier[None], ids[None], anchors, embed.weight)[0, 1], before)


def test_the_loss_is_deepspecs_per_slot_objective_and_trains_only_the_drafter():
    """Slot j of the block at a predicts the token at a + j + 1: cross-entropy against the target's argmax there and
    L1 against its distribution, mixed by the L1 share, weighted exp(−j/γ), over slots whose prediction and every
    earlier one are trained."""
    drafter, embed, lm_head = build()
    features, ids, final, loss_mask = sequence()
    loss_mask[12] = 0  # a hole: the block at 10 learns its slot 0 only (slot 1 predicts 12; the rest follow it)
    anchors = torch.tensor([[4, 10, 15]])
    gamma, share = 2.0, 0.3
    stats = spark_loss(drafter, features[None], ids[None], final[None], loss_mask[None].bool(), anchors,
                       torch.ones_like(anchors, dtype=torch.bool), embed.weight, lm_head, slot_weights(BLOCK, gamma),
                       share)
    target = (final @ lm_head.T).softmax(-1)
    total, weight, counted, runs, drawn = 0.0, 0.0, 0, [], []
    for anchor in anchors[0].tolist():
        _, logits = propose(drafter, context_of(drafter, features, anchor), ids[anchor].item(), anchor, embed, lm_head,
                            previous=ids[anchor : anchor + BLOCK].tolist())
        hits, chance, whole = [], [], True
        for j in range(BLOCK):
            if not all(loss_mask[anchor + i + 1] for i in range(j + 1)):
                whole = False
                break
            p = target[anchor + j]
            ce = nn.functional.cross_entropy(logits[j][None], p.argmax()[None])
            l1 = (logits[j].softmax(-1) - p).abs().sum()
            w = torch.exp(torch.tensor(-j / gamma, dtype=torch.float64))
            total += w * ((1 - share) * ce + share * l1)
            weight += w
            counted += 1
            hits.append(int(logits[j].argmax()) == int(p.argmax()))
            chance.append(1 - 0.5 * float(l1))
        if whole:
            runs.append(next((k for k, h in enumerate(hits) if not h), BLOCK))
            drawn.append(sum(float(torch.tensor(chance[: k + 1]).prod()) for k in range(BLOCK)))
    torch.testing.assert_close(stats.loss.double(), total / weight, rtol=1e-5, atol=1e-6)  # the loss in fp32
    assert int(stats.counted.sum()) == counted == BLOCK * 2 + 1
    assert int(stats.blocks) == len(runs) == 2 and int(stats.accepted) == sum(runs)
    assert float(stats.drawn_accepted) == pytest.approx(sum(drawn), rel=1e-5)
    stats.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert embed.weight.grad is None and not lm_head.requires_grad


def test_anchors_have_a_context_a_trained_next_token_and_every_proposal_inside():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    valid = torch.ones_like(loss_mask, dtype=torch.bool)
    anchors, usable = draw_anchors(loss_mask, valid, BLOCK, 100)
    allowed = sorted(anchors[usable].tolist())
    assert allowed == [a for a in range(1, 12) if a + BLOCK < 12 and loss_mask[0, a + 1]]
    valid[0, 9:] = False  # a shorter row: fewer places hold a whole block
    anchors, usable = draw_anchors(loss_mask, valid, BLOCK, 100)
    assert sorted(anchors[usable].tolist()) == [a for a in allowed if a + BLOCK < 9]


def test_parameter_names_are_the_checkpoint_names_vllm_loads():
    """vLLM 0.32's Qwen3DSpark loader (qwen3_dspark.py load_weights): DFlash's backbone names unprefixed, the Markov
    head as markov_head.markov_w1 [V, r] / markov_w2 [V, r], no embedding or lm_head (the target's are shared)."""
    drafter, _, _ = build(layers=1)
    names = {name: list(t.shape) for name, t in drafter.state_dict().items()}
    assert names.pop("markov_head.markov_w1.weight") == [VOCAB, RANK]
    assert names.pop("markov_head.markov_w2.weight") == [VOCAB, RANK]
    assert names.pop("fc.weight") == [HIDDEN, 3 * TARGET_HIDDEN]
    assert {n.split(".", 2)[-1] if n.startswith("layers.") else n for n in names} == {
        "hidden_norm.weight", "norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight"}


def test_export_writes_what_vllm_reads_and_reads_back_the_same_drafter(tmp_path):
    from eyas.families.dspark.export import load_dspark_dir, write_dspark_dir

    drafter, embed, lm_head = build(layers=2)
    write_dspark_dir(tmp_path / "draft", drafter, "fp32", max_position_embeddings=2048)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 2, 4]}  # outputs of layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and "eagle_config" not in config
    assert config["block_size"] == BLOCK and config["markov_rank"] == RANK and config["sample_from_anchor"] is True
    assert config["markov_head_type"] == "vanilla" and config["enable_confidence_head"] is False
    back = load_dspark_dir(tmp_path / "draft", torch.float64)
    features, ids, _, _ = sequence()
    for model in (back, drafter):
        model.eval()
    _, mine = propose(drafter, context_of(drafter, features, 9), ids[9].item(), 9, embed, lm_head)
    _, theirs = propose(back, context_of(back, features, 9), ids[9].item(), 9, embed, lm_head)
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)  # fp32 on disk
    config["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="not a DSpark drafter"):
        load_dspark_dir(tmp_path / "draft")


def test_eyas_check_holds_a_dspark_directory_to_what_vllm_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    from eyas.export.check import check_draft_dir
    from eyas.export.fit import TargetSizes
    from eyas.families import of_draft_dir
    from eyas.families.dspark.export import write_dspark_dir

    drafter, _, _ = build(layers=2)
    write_dspark_dir(tmp_path / "draft", drafter, "bf16", max_position_embeddings=2048)
    assert of_draft_dir(tmp_path / "draft").name == "dspark"
    assert check_draft_dir(tmp_path / "draft").ok
    assert check_draft_dir(tmp_path / "draft", TargetSizes("qwen3", 8, TARGET_HIDDEN, VOCAB)).ok
    other = check_draft_dir(tmp_path / "draft", TargetSizes("qwen3", 4, TARGET_HIDDEN * 2, VOCAB))
    assert any("target_hidden_size 24" in e for e in other.errors) and any("layer ids [5]" in e for e in other.errors)
    path = tmp_path / "draft" / "config.json"
    good = json.loads(path.read_text())
    for change, says in [(lambda c: c.update(eagle_config={"use_aux_hidden_state": True}), "has eagle_config"),
                         (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 5]), "name different states"),
                         (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), "outside the vocabulary"),
                         (lambda c: c.update(sample_from_anchor=False), "anchor-first block only"),
                         (lambda c: c.update(markov_rank=RANK * 2), "not the DSpark drafter its config describes"),
                         (lambda c: c.update(draft_vocab_size=50), "reduced draft vocabulary")]:
        config = json.loads(json.dumps(good))
        change(config)
        path.write_text(json.dumps(config))
        errors = check_draft_dir(tmp_path / "draft").errors
        assert any(says in e for e in errors), (says, errors)
    path.write_text(json.dumps(good))
    weights = tmp_path / "draft" / "model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "lm_head.weight": torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)}, weights)
    (tmp_path / "draft" / "manifest.json").unlink(missing_ok=True)  # the sha256 would name the edit first
    errors = check_draft_dir(tmp_path / "draft").errors
    assert any("lm_head" in e for e in errors), errors


def test_the_loss_in_checkpointed_chunks_equals_the_loss_in_one_and_so_do_its_gradients():
    """The full-vocabulary part runs a few slots at a time, recomputed in the backward pass: the loss, every statistic
    and every gradient are those of one chunk holding every slot."""
    drafter, embed, lm_head = build()
    features, ids, final, loss_mask = sequence(length=24)
    anchors = torch.tensor([[2, 6, 11, 15, 19]])
    usable = torch.tensor([[True, True, True, True, False]])

    def run(chunk_rows):
        drafter.zero_grad()
        stats = spark_loss(drafter, features[None], ids[None], final[None], loss_mask[None].bool(), anchors, usable,
                           embed.weight, lm_head, slot_weights(BLOCK, 3.0), 0.6, chunk_rows=chunk_rows)
        stats.loss.backward()
        return stats, {name: p.grad.clone() for name, p in drafter.named_parameters()}

    whole, expected = run(10_000)
    for rows in (1, 3, 7):
        stats, grads = run(rows)
        for field in ("loss", "shares", "correct", "counted", "accepted", "drawn_accepted", "blocks", "depth_counts"):
            torch.testing.assert_close(getattr(stats, field), getattr(whole, field), msg=f"{field}, chunks of {rows}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=f"{name}, chunks of {rows}")


@pytest.mark.parametrize(("change", "says"), [
    (lambda c: c.update(block_size=0), "block_size is 0: a DSpark drafter needs a whole number ≥ 1"),
    (lambda c: c.update(markov_rank="x"), "markov_rank is 'x'"),
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers is 0"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (lambda c: c["dflash_config"].update(mask_token_id=9999), "mask_token_id 9999 is outside the vocabulary"),
    (lambda c: c.update(rope_theta="x"), "rope_theta is 'x': a DSpark drafter needs a positive number"),
    (lambda c: c.update(max_position_embeddings=-5), "max_position_embeddings is -5"),
    (lambda c: c.update(dflash_config=5), "dflash_config is 5: an object"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="x"), "a list of whole numbers, not 'x'"),
    (lambda c: c.update(enable_confidence_head="yes"), "enable_confidence_head is 'yes': true or false"),
], ids=["block", "rank", "layers", "kv-heads", "mask", "rope", "positions", "dflash-config", "layer-ids", "confidence"])
def test_a_damaged_dspark_config_is_one_line_in_check_and_in_the_engine(tmp_path, change, says):
    """A hand-edited config.json: eyas check names the field, and so does loading the drafter for bench and generate
    (before this, an out-of-range mask token was an IndexError inside the first round)."""
    from eyas.errors import EyasError
    from eyas.export.check import check_draft_dir
    from eyas.families.dspark.export import load_dspark_dir, write_dspark_dir

    drafter, _, _ = build(layers=1)
    draft = write_dspark_dir(tmp_path / "draft", drafter, "fp32", max_position_embeddings=2048)
    config = json.loads((draft / "config.json").read_text())
    change(config)
    (draft / "config.json").write_text(json.dumps(config))
    assert any(says in e for e in check_draft_dir(draft).errors), check_draft_dir(draft).errors
    with pytest.raises(EyasError, match=re.escape(says)):
        load_dspark_dir(draft)


def test_the_confidence_head_learns_the_chance_a_drawn_draft_is_accepted_and_exports_as_vllm_reads_it(tmp_path):
    """With ``confidence_head``: each counted slot's loss gains BCE(confidence logit, 1 − ½·L1) — DeepSpec's — the
    head reads the slot's state and the Markov embedding of the token before it, its gradient reaches the backbone;
    the export says enable_confidence_head (with the Markov embedding) and holds confidence_head.proj, which eyas
    check holds to that."""
    from safetensors.torch import load_file, save_file

    from eyas.export.check import check_draft_dir
    from eyas.families.dspark.export import load_dspark_dir, write_dspark_dir

    drafter, embed, lm_head = build(confidence=True)
    features, ids, final, loss_mask = sequence()
    anchors = torch.tensor([[4, 10]])
    share = 0.3
    stats = spark_loss(drafter, features[None], ids[None], final[None], loss_mask[None].bool(), anchors,
                       torch.ones_like(anchors, dtype=torch.bool), embed.weight, lm_head, slot_weights(BLOCK, None),
                       share)
    hidden = spark_block_hidden(drafter, features[None], ids[None], anchors, embed.weight)[0]
    target = (final @ lm_head.T).softmax(-1)
    total, count = 0.0, 0
    for j, anchor in enumerate(anchors[0].tolist()):
        previous = ids[anchor : anchor + BLOCK]
        logits = drafter.slot_logits(hidden[j], lm_head, previous)
        for k in range(BLOCK):
            p = target[anchor + k]
            l1 = (logits[k].softmax(-1) - p).abs().sum()
            chance = 1 - 0.5 * l1.detach()
            logit = drafter.confidence_head.proj(torch.cat([hidden[j, k], drafter.markov_head.markov_w1(previous[k])]))
            total += ((1 - share) * nn.functional.cross_entropy(logits[k][None], p.argmax()[None]) + share * l1
                      + nn.functional.binary_cross_entropy_with_logits(logit[0], chance))
            count += 1
    torch.testing.assert_close(stats.loss.double(), total / count, rtol=1e-5, atol=1e-6)
    stats.loss.backward()
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0 and drafter.fc.weight.grad.abs().sum() > 0

    draft = write_dspark_dir(tmp_path / "draft", drafter, "fp32", max_position_embeddings=2048)
    config = json.loads((draft / "config.json").read_text())
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    tensors = load_file(draft / "model.safetensors")
    assert list(tensors["confidence_head.proj.weight"].shape) == [1, HIDDEN + RANK]
    assert list(tensors["confidence_head.proj.bias"].shape) == [1]
    back = load_dspark_dir(draft, torch.float64)
    torch.testing.assert_close(back.confidence_head.proj.weight, drafter.confidence_head.proj.weight.detach(),
                               rtol=1e-6, atol=1e-6)
    assert check_draft_dir(draft).ok
    config.update(enable_confidence_head=False, confidence_head_with_markov=False)  # the head left unread
    (draft / "config.json").write_text(json.dumps(config))
    assert any("vLLM would leave it unread" in e for e in check_draft_dir(draft).errors)
    config.update(enable_confidence_head=True)
    (draft / "config.json").write_text(json.dumps(config))
    assert any("without the Markov embedding" in e for e in check_draft_dir(draft).errors)
    plain, _, _ = build()
    config.update(confidence_head_with_markov=True)
    (draft / "config.json").write_text(json.dumps(config))
    save_file({n: t.float() for n, t in plain.state_dict().items()}, draft / "model.safetensors")
    assert any("confidence_head.proj" in e for e in check_draft_dir(draft).errors)  # enabled, and missing
