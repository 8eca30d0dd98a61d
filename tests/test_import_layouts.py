"""Third-party EAGLE-3 drafter directories load into eyas and draft exactly what they drafted before.

Each layout is written here the way its tool writes it (names, files, config fields), from one
random drafter; importing any of them must give the same drafts and logits as the original, so
`eyas bench` measures anyone's drafter, not a misread copy of it.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from eyas.errors import EyasError
from eyas.export.check import check_draft_dir
from eyas.families.eagle3.export import draft_config, draft_tensors
from eyas.export.files import write_draft_dir
from eyas.families.eagle3.load import import_draft_dir, load_drafter
from reference_drafting import greedy_chain
from test_drafter_consistency import random_drafter, tiny_config

LAYERS = 8  # the tiny targets' depth: default ids (2, 4, 5)


@pytest.fixture(scope="module")
def original():
    config = tiny_config(vocab_size=256, draft_vocab_size=100, layer_ids=[2, 4, 5])
    drafter = random_drafter(config)
    embedding = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    drafter.load_target_embedding(embedding)
    return drafter, embedding


def weights(drafter) -> dict[str, torch.Tensor]:
    tensors = {k: v.detach().clone() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    tensors["d2t"] = drafter.d2t.clone()
    return tensors


def t2d(drafter) -> torch.Tensor:
    mask = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    mask[torch.arange(drafter.config.draft_vocab_size) + drafter.d2t] = True
    return mask


def eagle_reference(directory, drafter):
    """SafeAILab/EAGLE releases: pytorch_model.bin with t2d, a bare config (no ids, no head_dim)."""
    directory.mkdir()
    c = drafter.config
    torch.save({**weights(drafter), "t2d": t2d(drafter)}, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "num_hidden_layers": 1, "bias": False, "torch_dtype": "float32"}))


def specforge_sharded(directory, drafter):
    """SpecForge's save_pretrained: midlayer.* safetensors (here sharded behind an index) with t2d."""
    config = draft_config(drafter.config, "llama", LAYERS, "fp32")
    write_draft_dir(directory, config, draft_tensors(weights(drafter), config, "fp32"), "")
    tensors = {**weights(drafter), "t2d": t2d(drafter)}
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / file))
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def speculators(directory, drafter, norm_before_residual=None):
    """vLLM speculators: layers.0.* names, the embedding included, the Llama config nested."""
    from eyas.families.eagle3.speculators import speculators_config

    config = speculators_config(draft_config(drafter.config, "llama", LAYERS, "fp32"), "some/target")
    if norm_before_residual is None:
        config.pop("norm_before_residual")  # the speculators default: true
    else:
        config["norm_before_residual"] = norm_before_residual
    tensors = {n.replace("midlayer.", "layers.0."): t for n, t in weights(drafter).items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().clone()
    tensors["t2d"] = t2d(drafter)
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))


def drafts_of(drafter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 9, drafter.config.aux_width, generator=gen)
    tokens = torch.randint(0, 256, (1, 9), generator=gen)
    with torch.no_grad():
        return greedy_chain(drafter, aux, tokens, 4)


@pytest.mark.parametrize("layout", [eagle_reference, specforge_sharded,
                                    lambda d, m: speculators(d, m, norm_before_residual=False)],
                         ids=["eagle-reference-bin", "specforge-sharded", "speculators"])
def test_third_party_layouts_draft_exactly_like_the_original(original, tmp_path, layout):
    drafter, embedding = original
    layout(tmp_path / "draft", drafter)
    imported = load_drafter(tmp_path / "draft", embedding, LAYERS)
    assert imported.config.layer_ids == [2, 4, 5]
    assert torch.equal(imported.d2t, drafter.d2t)
    (want_logits, want_ids), (got_logits, got_ids) = drafts_of(drafter), drafts_of(imported)
    for want, got in zip(want_logits, got_logits, strict=True):
        assert torch.equal(want, got)
    assert [t.tolist() for t in want_ids] == [t.tolist() for t in got_ids]
    result = check_draft_dir(tmp_path / "draft")
    assert result.ok, result.errors
    assert any("t2d" in w for w in result.warnings)


def test_speculators_default_normalises_the_residual(original, tmp_path):
    drafter, embedding = original
    speculators(tmp_path / "draft", drafter)  # norm_before_residual left to the format's default
    imported = load_drafter(tmp_path / "draft", embedding, LAYERS)
    assert imported.config.norm_before_residual is True
    layer = imported.midlayer
    gen = torch.Generator().manual_seed(5)
    hidden, embeds = torch.randn(1, 3, 64, generator=gen), torch.randn(1, 3, 64, generator=gen)
    positions = torch.arange(3).unsqueeze(0)
    cos, sin = imported.rotary(hidden, positions)

    def causal(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        normed = layer.hidden_norm(hidden)
        residual = normed + layer.self_attn(torch.cat([layer.input_layernorm(embeds), normed], -1), cos, sin, causal)
        expected = residual + layer.mlp(layer.post_attention_layernorm(residual))  # vLLM's norm_before_residual=True
        assert torch.allclose(layer(embeds, hidden, cos, sin, causal), expected, rtol=0, atol=1e-6)
    with pytest.raises(EyasError, match="SGLang cannot run that"):
        draft_config(imported.config, "llama", LAYERS, "bf16")


def test_what_eyas_cannot_run_is_refused_by_name(original, tmp_path):
    drafter, _ = original
    specforge_sharded(tmp_path / "variant", drafter)
    config = json.loads((tmp_path / "variant" / "config.json").read_text())
    (tmp_path / "variant" / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(EyasError, match="norm_before_fc"):
        import_draft_dir(tmp_path / "variant", LAYERS)

    eagle2 = tmp_path / "eagle2"
    eagle_reference(eagle2, drafter)
    state = torch.load(eagle2 / "pytorch_model.bin", weights_only=True)
    state.pop("midlayer.hidden_norm.weight")
    torch.save(state, eagle2 / "pytorch_model.bin")
    with pytest.raises(EyasError, match="not an EAGLE-3 drafter"):
        import_draft_dir(eagle2, LAYERS)


class NotATensor:
    pass


def test_a_pickle_with_code_in_it_is_never_unpickled(original, tmp_path):
    drafter, _ = original
    eagle_reference(tmp_path / "draft", drafter)
    torch.save({"fc.weight": torch.zeros(1), "payload": NotATensor()}, tmp_path / "draft" / "pytorch_model.bin")
    with pytest.raises(EyasError, match="never unpickles code"):
        import_draft_dir(tmp_path / "draft", LAYERS)
    assert not check_draft_dir(tmp_path / "draft").ok
