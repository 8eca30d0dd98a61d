"""releases/: what the repository ships for users to run (data journals, drafters), pinned by sha256."""

import hashlib
import lzma
import shutil

import pytest

from eyas.data.regenerate import parse_journal
from eyas.errors import EyasError
from eyas.releases import MANIFEST, read_manifest, release_problems
from eyas.releases import ROOT as RELEASES


def test_manifest_lists_every_file_with_its_sha256():
    assert release_problems() == []


def test_a_changed_an_unlisted_and_a_missing_file_are_each_named(tmp_path):
    root = tmp_path / "releases"
    (root / "drafter").mkdir(parents=True)
    files = {"drafter/config.json": b"{}", "drafter/model.safetensors": b"weights", "README.md": b"# r"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / MANIFEST).write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items()))
    assert release_problems(root=root) == [] and release_problems(root / "drafter", root) == []
    (root / "drafter" / "model.safetensors").write_bytes(b"weightz")
    (root / "drafter" / "extra.txt").write_text("x")
    (root / "README.md").unlink()
    assert release_problems(root / "drafter", root) == [
        "drafter/extra.txt: not in MANIFEST.sha256", "drafter/model.safetensors: sha256 differs from MANIFEST.sha256"]
    assert "README.md: listed in MANIFEST.sha256 but missing" in release_problems(root=root)
    (root / MANIFEST).write_text("nonsense\n")
    with pytest.raises(EyasError, match="line 1"):
        read_manifest(root)
    shutil.rmtree(root)


def test_released_journals_are_complete_regeneration_journals():
    journals = sorted(RELEASES.glob("data/*/regenerated.jsonl.xz"))
    assert journals, "releases/data holds no journal"
    for journal in journals:
        data = lzma.decompress(journal.read_bytes())
        assert data.endswith(b"\n"), f"{journal}: last line torn"
        conversations = parse_journal(journal, data)
        assert len(conversations) == data.count(b"\n"), f"{journal}: a conversation appears twice"
        for conversation in conversations.values():
            answers = [t for t in conversation.turns if t.role == "assistant"]
            assert answers and all(t.regenerated and t.content.strip() for t in answers), conversation.id


def test_every_released_drafter_passes_eyas_check(tmp_path):
    """Each drafter the manifest lists (a folder with a config.json) is as released and passes `eyas check`, the
    export contract vLLM and SGLang load by. A broken one is caught: the same check fails a copy with its config
    altered."""
    import json

    from eyas.export.check import check_draft_dir

    drafters = sorted({name.rsplit("/", 1)[0] for name in read_manifest() if name.endswith("/config.json")})
    assert drafters, "releases/ holds no drafter"
    for folder in drafters:
        assert release_problems(RELEASES / folder) == [], folder
        result = check_draft_dir(RELEASES / folder)
        assert result.ok, (folder, result.errors)
        broken = tmp_path / folder
        shutil.copytree(RELEASES / folder, broken)
        config = json.loads((broken / "config.json").read_text())
        config["hidden_size"] += 1
        (broken / "config.json").write_text(json.dumps(config))
        assert not check_draft_dir(broken).ok, folder
