"""A drafter family from outside eyas: tests/toy_family.py registers through $EYAS_FAMILIES and goes through
`eyas train / export / check / bench` — losslessly — with no file under src/ naming it; and no file outside a built-in
family's folder (and the registry) names that family."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from eyas.engine.acceptance import Sampling
from eyas.engine.decode import generate
from eyas.speculation import Chain
from eyas.engine.target_runner import TargetRunner
from eyas.families import BuildInputs
from eyas.target.layer_ids import default_layer_ids
from eyas.target.layout import discover_layout
from test_engine_greedy import prompt_of, reference_greedy
from test_engine_tree_sampling import assert_second_token_follows, first_two_distributions
from zoo import ARCHITECTURES

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src" / "eyas"


def eyas(*args: str, plugin: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    if plugin:
        env["EYAS_FAMILIES"] = "toy_family"
    else:
        env.pop("EYAS_FAMILIES", None)
    return subprocess.run([sys.executable, "-m", "eyas", *args], capture_output=True, text=True, env=env, timeout=600)


def test_a_family_from_outside_trains_exports_checks_and_decodes_losslessly(tmp_path):
    target, data, features = zoo.tiny_store(tmp_path)
    run, draft, report = tmp_path / "run", tmp_path / "draft", tmp_path / "report"
    refused = eyas("train", "--target", target, "--features", str(features), "--out", str(run), "--drafter", "toy",
                   plugin=False)
    assert refused.returncode != 0 and "toy" in refused.stderr + refused.stdout  # unknown without its registration
    trained = eyas("train", "--target", target, "--features", str(features), "--out", str(run), "--drafter", "toy",
                   "--toy-heads", "2", "--max-steps", "30", "--token-budget", "256", "--checkpoint-every", "30",
                   "--lr", "1e-2")
    assert trained.returncode == 0, trained.stderr
    options = json.loads((run / "train_options.json").read_text())
    assert options["drafter"] == "toy" and options["toy_heads"] == 2
    assert "a chain of 2 heads" in trained.stdout  # the family's own meaning of its simulated τ
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["eval"]["loss"] < lines[0]["eval"]["loss"]  # it learns

    exported = eyas("export", str(run), "--out", str(draft), "--dtype", "fp32")
    assert exported.returncode == 0 and "eyas check: ok" in exported.stdout, exported.stdout + exported.stderr
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["EyasToyHead"]
    checked = eyas("check", str(draft))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    wrong = eyas("export", str(run), "--out", str(tmp_path / "wrong"), "--format", "eagle3")
    assert wrong.returncode != 0 and "--format toy" in wrong.stderr + wrong.stdout

    benched = eyas("bench", "--target", target, "--draft", str(draft), "--out", str(report), "--dataset",
                   "sharegpt-holdout", "--data", str(data), "--max-new-tokens", "12", "--device", "cpu", "--dtype", "fp32")
    assert benched.returncode == 0, benched.stdout + benched.stderr
    rows = {(row["mode"], row["temperature"]): row for row in json.loads((report / "report.json").read_text())["rows"]}
    greedy = rows["chain:2", 0.0]  # the family's default mode: its heads' whole chain
    assert greedy["prompts"] > 0 and greedy["matches_plain"] == greedy["prompts"]  # every answer equals plain decoding
    assert greedy["tau"] >= 1.0 and ("chain:2 drawn", 1.0) in rows


def toy_runner(model, heads: int, capacity: int = 96, seed: int = 0):
    from toy_family import TOY

    layout = discover_layout(model)
    ids = default_layer_ids(layout.num_layers)
    options = type("Options", (), {"seed": seed, "toy_heads": heads})
    built = TOY.build(BuildInputs(model.config, ids, options, layout.lm_head.weight.detach(),
                                  layout.embed.weight.detach(), Path("-"), torch.device("cpu"), torch.float32))
    _, _, _, ToyRunner = __import__("toy_family")._modules()
    return TargetRunner(model, layout, ids, capacity), ToyRunner(built.drafter.eval(), layout.lm_head, capacity + 16)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_outside_family_decodes_losslessly_on_every_architecture(arch):
    model = ARCHITECTURES[arch][0]()
    target, runner = toy_runner(model, heads=3)
    prompt = prompt_of(3)
    expected = reference_greedy(model, prompt, 16)
    assert generate(target, prompt, 16, runner, Chain(3)).tokens == expected


def test_the_outside_family_samples_the_target_distribution():
    model = ARCHITECTURES["llama"][0]()
    target, runner = toy_runner(model, heads=2, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    wanted = torch.full((256,), 1e-9)
    wanted[second_probs.topk(2).indices] = torch.tensor([0.6, 0.4])
    runner.slot_logits = lambda root, anchor, steps: (0.05 * wanted.log()).expand(steps, -1)
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, runner, Chain(2), Sampling(
            temperature=0.05, seed=seed, draft_sampling="probabilistic")),
        first, second_probs, seeds=600, least=150)


# Where a built-in family's name may appear under src/eyas: its own folder, the folder of a family that builds on it
# (DSpark on DFlash's backbone), and the registry — never the stages, the engine or another family.
FAMILIES = SRC / "families"
REGISTRY = FAMILIES / "__init__.py"
FOLDERS = {"dflash": ("dflash", "dspark"), "dspark": ("dspark",)}


@pytest.mark.parametrize("family", list(FOLDERS))
def test_no_file_outside_its_folder_and_those_building_on_it_names_it(family):
    named = []
    for path in sorted(SRC.rglob("*.py")):
        if path == REGISTRY or any(FAMILIES / folder in path.parents for folder in FOLDERS[family]):
            continue
        named += [f"{path.relative_to(SRC)}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                  if re.search(family, line, re.IGNORECASE)]
    assert not named, f"{family} is named outside its folder: {named}"
