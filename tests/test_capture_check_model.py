"""capture --check's error model: it passes correct captures in every store dtype and fails the ~1 % corruption of
issue 28 (vLLM's MLA rotary bug), which the old max|Δ|/max|x| tolerance passed in a bf16 store."""

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import zoo
from eyas.capture.options import CaptureOptions
from eyas.capture.stage import capture
from eyas.cli import app
from eyas.store import fp8
from eyas.store.check import check_store, print_check
from eyas.store.error_model import COMPUTE_NOISE, beyond_rounding, noise_bound, token_errors
from eyas.store.shards import DTYPES
from eyas.target import capture_hidden_states, discover_layout

STORE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
BOUND = COMPUTE_NOISE["float32"]
ANGLE = 0.013  # radians at the last token: at most ~1 % per token, as in issue 28


def rotary_corruption(states: torch.Tensor, angle: float) -> torch.Tensor:
    """Issue 28's kind of error: the rotary half of each layer's channels turned by an angle growing with the position
    (0 at token 0, ``angle`` at the last), as a wrong q_pe/k_pe leaves it. ``states`` [..., T, k·64]."""
    out = states.clone()
    turn = angle * torch.linspace(0, 1, states.shape[-2]).unsqueeze(-1)
    for start in range(32, states.shape[-1], 64):
        a, b = states[..., start:start + 32:2], states[..., start + 1:start + 32:2]
        out[..., start:start + 32:2] = a * turn.cos() - b * turn.sin()
        out[..., start + 1:start + 32:2] = a * turn.sin() + b * turn.cos()
    return out


def stored_as(states: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``states`` [T, H] as a ``dtype`` store holds them (read back in float32), and the fp8 scale."""
    if dtype == "fp8":
        q, scale = fp8.quantize(states, 1)
        return fp8.dequantize(q, scale, torch.float32), scale
    return states.to(DTYPES[dtype]).float(), None


@pytest.fixture(scope="module")
def batched_and_alone():
    """Per model, four right-padded samples captured in one batch (as the store captures them) and each alone (as the
    check re-captures it), fp32 compute: [(captured layer-2 states, live ones)] per sample and model."""
    torch.manual_seed(0)
    lengths = (60, 41, 23, 9)
    ids = torch.randint(1, 250, (len(lengths), max(lengths)))
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths).unsqueeze(1)).long()
    pairs = {}
    for name in ("llama", "deepseek_v3"):
        model = zoo.ARCHITECTURES[name][0]()
        layout = discover_layout(model)
        batch = capture_hidden_states(model, layout, ids * mask, attention_mask=mask)
        pairs[name] = [(batch.aux[i, :n, :64], capture_hidden_states(model, layout, ids[i:i + 1, :n]).aux[0, :, :64])
                       for i, n in enumerate(lengths)]
    return pairs


def worst(pairs, dtype: str, change=lambda x: x) -> tuple[float, float]:
    """Worst per-token (error beyond rounding, old max|Δ|/max|live|) over the pairs, stored as ``dtype`` after ``change``."""
    rel, old = 0.0, 0.0
    for captured, live in pairs:
        stored, scale = stored_as(change(captured), dtype)
        rel = max(rel, token_errors(stored, live, dtype, scale)[0].max().item())
        old = max(old, ((stored - live).abs().max() / live.abs().max()).item())
    return rel, old


@pytest.mark.parametrize("dtype", STORE_DTYPES)
def test_the_error_beyond_rounding_is_the_distance_outside_the_stored_value_s_rounding_cell(dtype):
    live = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3
    stored, scale = stored_as(live, dtype)
    assert torch.equal(beyond_rounding(stored, live, dtype, scale), torch.zeros_like(live))  # rounded from live: 0
    if dtype == "fp32":
        return  # its cells are below float32's own resolution: nothing more to pin
    half_up = {"fp16": 2**-11, "bf16": 2**-8, "fp8": 2**-4}[dtype]  # half the gap above 1.0, a power of two
    unit = 1.0 if scale is None else 2.0**-5  # fp8: a token whose largest value, 14, maps to 448 at scale 2^-5
    codes = torch.tensor([[1.0, 1.0, 1.5, 448.0]])
    live = torch.tensor([[1 + 1.25 * half_up, 1 - 1.25 * half_up / 2, 1.5 + 0.75 * half_up, 448.0]])
    scale = torch.tensor([[unit]]) if dtype == "fp8" else None
    distance = beyond_rounding(codes * unit, live * unit, dtype, scale)[0] / unit
    # above 1.0 the cell reaches half a gap up; below it only a quarter (the binade below is twice as fine)
    torch.testing.assert_close(distance, torch.tensor([0.25 * half_up, 0.125 * half_up, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", STORE_DTYPES)
def test_correct_captures_pass_with_a_clear_margin(batched_and_alone, dtype):
    noise = torch.Generator().manual_seed(1)
    for name, pairs in batched_and_alone.items():
        rel, _ = worst(pairs, dtype)
        engine, _ = worst(pairs, dtype, lambda x: x * (1 + 1e-6 * torch.randn(x.shape, generator=noise)))  # vLLM vs HF
        print(f"{name} {dtype}: correct {rel:.2g}, with 1e-6 engine noise {engine:.2g}, bound {BOUND:g}")
        assert rel <= BOUND / 20 and engine <= BOUND / 20  # a margin of 20× at least (measured: 50× and more)


@pytest.mark.parametrize("dtype", STORE_DTYPES)
def test_a_one_percent_rotary_corruption_fails_in_every_store_dtype(batched_and_alone, dtype):
    for name, pairs in batched_and_alone.items():
        true_rel = max(((rotary_corruption(c, ANGLE) - live).norm(dim=-1) / live.norm(dim=-1)).max().item()
                       for c, live in pairs)
        rel, old = worst(pairs, dtype, lambda x: rotary_corruption(x, ANGLE))
        print(f"{name} {dtype}: corrupted by {true_rel:.2%} per token at most: error beyond rounding {rel:.2g} "
              f"(bound {BOUND:g}), old max|Δ|/max|x| {old:.3g}")
        assert 0.009 < true_rel < 0.012 and rel > 20 * BOUND
        if dtype == "bf16":
            assert old < 1.6e-2  # what the old check compared with its bf16 tolerance, 1.6e-2: it passed this


def test_bf16_compute_has_its_own_looser_bound_which_cannot_see_one_percent(batched_and_alone):
    assert noise_bound("float32", "float32") == (COMPUTE_NOISE["float32"], "float32")
    assert noise_bound("float32", "bfloat16") == (COMPUTE_NOISE["bfloat16"], "bfloat16")
    assert noise_bound(None, "float32") == (COMPUTE_NOISE["bfloat16"], "bfloat16")  # a store that did not record it
    torch.manual_seed(0)
    ids = torch.randint(1, 250, (3, 60))
    for name in ("llama", "deepseek_v3"):  # a correct capture computed in bf16, stored in bf16, against fp32
        build = zoo.ARCHITECTURES[name][0]
        fp32, bf16 = build(), build().to(torch.bfloat16)
        live = capture_hidden_states(fp32, discover_layout(fp32), ids)
        captured = capture_hidden_states(bf16, discover_layout(bf16), ids)
        rel = max(token_errors(captured.aux[i, :, k * 64:(k + 1) * 64].float(), live.aux[i, :, k * 64:(k + 1) * 64],
                               "bf16")[0].max().item() for i in range(3) for k in range(3))
        print(f"{name}: bf16 compute vs fp32, worst token {rel:.3g}, bf16 bound {COMPUTE_NOISE['bfloat16']:g}")
        assert COMPUTE_NOISE["float32"] * 10 < rel < COMPUTE_NOISE["bfloat16"] / 1.5
    corrupted, _ = worst(batched_and_alone["deepseek_v3"], "bf16", lambda x: rotary_corruption(x, ANGLE))
    assert corrupted < COMPUTE_NOISE["bfloat16"]  # the limitation the report states: ~1 % passes a bf16-compute check


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("check-model")
    zoo.deepseek_v3().save_pretrained(root / "target")
    return str(root / "target"), zoo.write_data_dir(root / "data", sizes=(("train", 6),))


def capture_into(target, data, out, dtype, monkeypatch=None):
    """Capture DATA_DIR's train split; with ``monkeypatch``, every captured state is corrupted as issue 28's were."""
    if monkeypatch is not None:
        import eyas.target

        real = eyas.target.capture_hidden_states

        def corrupted(*args, **kwargs):
            states = real(*args, **kwargs)
            states.aux, states.final = rotary_corruption(states.aux, ANGLE), rotary_corruption(states.final, ANGLE)
            return states

        monkeypatch.setattr(eyas.target, "capture_hidden_states", corrupted)
    capture(CaptureOptions(target=target, data=data, out=out, dtype=dtype, splits=("train",), token_budget=256,
                           max_batch=4, shard_mb=0))
    if monkeypatch is not None:
        monkeypatch.undo()
    return out


def test_check_of_a_real_store_reports_each_layer_and_fails_the_corrupted_one(deepseek, tmp_path, monkeypatch):
    target, data = deepseek
    good = capture_into(target, data, tmp_path / "good", "bf16")
    assert json.loads((good / "manifest.json").read_text())["compute_dtype"] == "float32"
    report = check_store(good, samples=3)
    assert report.ok and report.bound == BOUND and set(report.tensors) == {"layer 2", "layer 4", "layer 5", "final"}
    assert all(fit.tokens > 0 and fit.worst_rel <= BOUND / 20 and fit.min_cos > 0.999 for fit in report.tensors.values())
    result = CliRunner().invoke(app, ["capture", "--check", str(good), "--check-samples", "3"])
    assert result.exit_code == 0 and "layer 5" in result.output and "OK" in result.output

    bad = capture_into(target, data, tmp_path / "bad", "bf16", monkeypatch)
    report = check_store(bad, samples=3)
    assert not report.ok and not report.bad_checksums and not report.count_problems  # intact files, wrong states
    assert all(fit.worst_rel > 20 * BOUND for fit in report.tensors.values())  # every layer id and the final hidden
    console = Console(record=True, width=250)
    with pytest.raises(SystemExit) as exit_:
        print_check(console, report)
    text = console.export_text()
    assert exit_.value.code == 1 and "FAIL" in text and "FAILED" in text and "worst rel. error beyond rounding" in text
    result = CliRunner().invoke(app, ["capture", "--check", str(bad), "--check-samples", "3"])
    assert result.exit_code == 1 and "FAILED" in result.output


def test_a_store_without_its_compute_dtype_is_judged_by_the_loose_bound_and_says_so(deepseek, tmp_path):
    target, data = deepseek
    store = capture_into(target, data, tmp_path / "fp8", "fp8")
    assert check_store(store, samples=2).ok  # fp8 at its own per-token scales, float32 bound
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["compute_dtype"]  # as eyas wrote stores before it recorded the compute dtype
    (store / "manifest.json").write_text(json.dumps(manifest))
    report = check_store(store, samples=2)
    assert report.ok and report.bound == COMPUTE_NOISE["bfloat16"] and report.compute["capture"] is None
    console = Console(record=True, width=400)
    print_check(console, report)
    text = console.export_text()
    assert "capture not recorded" in text and "cannot resolve errors below 25%" in text


def test_the_re_capture_runs_in_the_dtype_check_dtype_names(deepseek, tmp_path):
    """On a GPU the target loads in bfloat16 by default, whose bound cannot see ~1 %: --check-dtype float32 re-captures
    in float32 (the tight bound when the capture ran in float32 too); the dtype is checked before anything loads."""
    target, data = deepseek
    store = capture_into(target, data, tmp_path / "store", "bf16")
    report = check_store(store, samples=2, compute_dtype="bfloat16")
    assert report.compute == {"capture": "float32", "re-capture": "bfloat16"} and report.bound == COMPUTE_NOISE["bfloat16"]
    assert report.ok  # a correct capture passes the looser bound too
    report = check_store(store, samples=2, compute_dtype="float32")
    assert report.compute["re-capture"] == "float32" and report.bound == BOUND and report.ok
    result = CliRunner().invoke(app, ["capture", "--check", str(store), "--check-samples", "2", "--check-dtype", "bfloat16"])
    assert result.exit_code == 0 and "re-capture bfloat16" in result.output, result.output
    result = CliRunner().invoke(app, ["capture", "--check", str(store), "--check-dtype", "float64"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "--check-dtype float64" in lines[0], result.output
