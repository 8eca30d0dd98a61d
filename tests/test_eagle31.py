"""EAGLE-3.1's norms (``fc_norm``, ``norm_output``): the arithmetic vLLM's and SGLang's EAGLE-3 models run when a
drafter's config.json sets them, trained by `eyas train --fc-norm --norm-output`, exported so the engines switch them
on, checked, and imported back to draft the same tokens.

vLLM 0.32 (``model_executor/models/llama_eagle3.py``): ``combine_hidden_states`` splits the concatenated target
states into one chunk per state and applies ``fc_norm[i]`` (an RMSNorm, Ht wide) to chunk i before ``fc``; the model's
``forward`` returns ``(norm(h), aux)`` with ``aux = norm(h)`` under ``norm_output``, else the pre-norm ``h``; the
logits come from ``norm(h)``; ``aux`` is the next drafting step's hidden.
"""

import json

import pytest
import torch

import zoo
from eyas.errors import EyasError
from eyas.export.check import check_draft_dir
from eyas.export.files import write_draft_dir
from eyas.export.stage import export_run
from eyas.families.eagle3.export import draft_config, draft_tensors
from eyas.families.eagle3.load import import_draft_dir, load_drafter
from eyas.families.eagle3.speculators import speculators_config
from reference_drafting import greedy_chain
from test_drafter_consistency import random_drafter, tiny_config

LAYERS = 8  # tiny_config's default ids (2, 4, 5) are this depth's defaults


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("fc_norm, norm_output", [(True, True), (True, False), (False, True), (False, False)])
def test_the_norms_compute_what_the_engines_compute(fc_norm, norm_output):
    config = tiny_config(fc_norm=fc_norm, norm_output=norm_output)
    drafter = random_drafter(config)
    gen = torch.Generator().manual_seed(7)
    aux = torch.randn(1, 5, config.aux_width, generator=gen)
    ids = torch.randint(0, config.vocab_size, (1, 5), generator=gen)
    positions = torch.arange(5).unsqueeze(0)
    eps, width = config.rms_norm_eps, config.target_hidden_size
    with torch.no_grad():
        states = [aux[..., i * width : (i + 1) * width] for i in range(3)]
        if fc_norm:
            assert [tuple(n.weight.shape) for n in drafter.fc_norm] == [(width,)] * 3
            states = [rms(s, n.weight, eps) for s, n in zip(states, drafter.fc_norm, strict=True)]
        first = torch.cat(states, -1) @ drafter.fc.weight.T
        torch.testing.assert_close(drafter.fuse(aux), first, rtol=1e-5, atol=1e-5)

        embeds = drafter.embed_tokens(ids)
        cos, sin = drafter.rotary(first, positions)
        out = drafter.midlayer(embeds, first, cos, sin, causal)  # the layer itself is pinned elsewhere
        normed = rms(out, drafter.norm.weight, eps)
        handed_on = normed if norm_output else out
        step = drafter.layer(first, ids, positions, causal)
        torch.testing.assert_close(step, handed_on, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(drafter.logits(step), normed @ drafter.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    assert hasattr(drafter, "fc_norm") == fc_norm  # a plain drafter has no such tensors to export


def test_under_the_trainings_autocast_the_state_handed_on_keeps_the_layers_precision():
    """Training on a GPU runs fp32 master weights under bf16 autocast. The output norm's fp32 weight must not widen the
    hidden handed to the next TTT step to fp32 (and with it that step's rotary, q and k, which the flash kernel's
    backward refuses: "FlashAttention only support fp16 and bf16", an H100, 2026-12-07): it stays the layer's bf16, as
    the step a plain drafter hands on, and as an engine running the drafter in bf16 hands it on."""
    gen = torch.Generator().manual_seed(3)
    for norm_output in (False, True):
        config = tiny_config(fc_norm=True, norm_output=norm_output)
        drafter = random_drafter(config)
        aux = torch.randn(1, 5, config.aux_width, generator=gen)
        ids = torch.randint(0, config.vocab_size, (1, 5), generator=gen)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            first = drafter.fuse(aux)
            step = drafter.layer(first, ids, torch.arange(5).unsqueeze(0), causal)
            again = drafter.layer(step, ids, torch.arange(1, 6).unsqueeze(0), causal)
        assert (first.dtype, step.dtype, again.dtype) == (torch.bfloat16,) * 3, norm_output


def _weights(drafter) -> dict[str, torch.Tensor]:
    tensors = {k: v.detach().clone() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    tensors["d2t"] = drafter.d2t.clone()
    return tensors


def _drafts(drafter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 9, drafter.config.aux_width, generator=gen)
    tokens = torch.randint(0, drafter.config.vocab_size, (1, 9), generator=gen)
    with torch.no_grad():
        return greedy_chain(drafter, aux, tokens, 4)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_exported_with_the_switches_the_engines_read_and_imported_back_it_drafts_the_same(tmp_path, fmt):
    drafter = random_drafter(tiny_config(fc_norm=True, norm_output=True))
    embedding = torch.randn(drafter.config.vocab_size, 64, generator=torch.Generator().manual_seed(3))
    drafter.load_target_embedding(embedding)
    config = draft_config(drafter.config, "llama", LAYERS, "fp32")
    assert config["fc_norm"] is True and config["norm_output"] is True  # top level: where vLLM and SGLang read them
    tensors = draft_tensors(_weights(drafter), config, "fp32")
    assert [n for n in tensors if n.startswith("fc_norm")] == ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    if fmt == "speculators":
        config = speculators_config(config, "some/target")
        assert config["fc_norm"] is True and config["norm_output"] is True
        assert "fc_norm" not in config["transformer_layer_config"]
    write_draft_dir(tmp_path / "draft", config, tensors, "")
    result = check_draft_dir(tmp_path / "draft")
    assert result.ok, result.errors
    assert any("EAGLE-3.1" in w for w in result.warnings)
    imported = load_drafter(tmp_path / "draft", embedding, LAYERS)
    assert imported.config.fc_norm and imported.config.norm_output
    (want_logits, want_ids), (got_logits, got_ids) = _drafts(drafter), _drafts(imported)
    for want, got in zip(want_logits, got_logits, strict=True):
        assert torch.equal(want, got)
    assert [t.tolist() for t in want_ids] == [t.tolist() for t in got_ids]

    plain = draft_config(random_drafter(tiny_config()).config, "llama", LAYERS, "fp32")
    assert "fc_norm" not in plain and "norm_output" not in plain  # a plain drafter's config stays what older engines read


def test_a_switch_only_in_eagle_config_is_refused_where_the_engines_would_not_see_it(tmp_path):
    drafter = random_drafter(tiny_config(fc_norm=True))
    config = draft_config(drafter.config, "llama", LAYERS, "fp32")
    tensors = draft_tensors(_weights(drafter), config, "fp32")
    config.pop("fc_norm")
    config["eagle_config"]["fc_norm"] = True
    write_draft_dir(tmp_path / "draft", config, tensors, "")
    with pytest.raises(EyasError, match="eagle_config.fc_norm is True but the top-level fc_norm"):
        import_draft_dir(tmp_path / "draft", LAYERS)
    assert any("eagle_config.fc_norm" in e for e in check_draft_dir(tmp_path / "draft").errors)


def test_train_with_the_norms_learns_and_exports_a_drafter_that_drafts_what_it_trained(tmp_path_factory):
    from eyas.train.options import TrainOptions
    from eyas.train.trainer import train

    target, _, features = zoo.tiny_store(tmp_path_factory.mktemp("e31"))
    run = tmp_path_factory.mktemp("e31-run") / "run"
    report = train(TrainOptions(target=target, out=run, features=features, max_steps=40, token_budget=256,
                                checkpoint_every=40, lr=3e-3, ttt_steps=3, fc_norm=True, norm_output=True))
    first, last = report.initial_eval, report.final_eval
    assert last["loss"] < first["loss"]
    assert last["acceptance_cumulative"][0] > first["acceptance_cumulative"][0]
    draft = run.parent / "draft"
    export_run(run, draft, dtype="fp32")
    config = json.loads((draft / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert "EAGLE-3.1" in (draft / "README.md").read_text()
    from safetensors.torch import load_file

    trained = load_file(run / "final" / "model.safetensors")
    norms = [trained[f"fc_norm.{i}.weight"] for i in range(3)]
    assert all(not torch.equal(n, torch.ones_like(n)) for n in norms)  # trained, not left at their initial ones
    exported = load_file(draft / "model.safetensors")
    for i, norm in enumerate(norms):
        assert torch.equal(exported[f"fc_norm.{i}.weight"], norm)
