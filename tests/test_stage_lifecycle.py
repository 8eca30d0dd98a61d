"""One stage-directory lifecycle (eyas.outputs.StageOut) for every stage: the writer lock, the claim, the comparison
with an earlier output's inputs, the free space, the writes — no stage applies those rules on its own."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "eyas"
RULES = {"claim_out", "check_space", "refuse_other_inputs"}  # eyas.outputs' rules, applied through StageOut only
STAGES = {"prepare": "data/prepare.py", "capture": "capture/stage.py", "train": "train/trainer.py",
          "export": "export/stage.py", "bench": "bench/stage.py"}


def calls(path: Path) -> list[tuple[int, str]]:
    """Every call in ``path`` by the name it calls (``f(...)`` and ``x.f(...)`` alike)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            found.append((node.lineno, name))
    return found


def test_no_module_but_the_lifecycle_applies_its_rules():
    direct = [f"{path.relative_to(SOURCE)}:{line} {name}" for path in sorted(SOURCE.rglob("*.py"))
              if path != SOURCE / "outputs.py" for line, name in calls(path) if name in RULES]
    assert not direct, f"call StageOut's methods instead: {direct}"


def test_every_stage_claims_its_out_through_the_lifecycle_under_the_writer_lock():
    for stage, module in STAGES.items():
        text = (SOURCE / module).read_text(encoding="utf-8")
        assert f'StageOut.claim("{stage}"' in text, f"{module} does not claim its --out through StageOut"
        assert f'@one_writer("{stage}"' in text, f"{module}'s stage function does not hold the writer lock"
