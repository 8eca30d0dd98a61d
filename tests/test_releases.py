"""releases/: what the repository ships for users to run (data journals, drafters), pinned by sha256."""

import gzip
import hashlib
from pathlib import Path

from eyas.data.regenerate import parse_journal

RELEASES = Path(__file__).resolve().parent.parent / "releases"
MANIFEST = RELEASES / "MANIFEST.sha256"


def _manifest() -> dict[str, str]:
    entries = {}
    for number, line in enumerate(MANIFEST.read_text().splitlines(), start=1):
        digest, _, name = line.partition("  ")
        assert len(digest) == 64 and name, f"{MANIFEST} line {number} is not '<sha256>  <path>': {line!r}"
        assert name not in entries, f"{MANIFEST} lists {name} twice"
        entries[name] = digest
    return entries


def test_manifest_lists_every_file_with_its_sha256():
    files = {p.relative_to(RELEASES).as_posix() for p in RELEASES.rglob("*") if p.is_file() and p != MANIFEST}
    entries = _manifest()
    assert set(entries) == files, f"not in the manifest: {sorted(files - set(entries))}; " \
                                  f"listed but missing: {sorted(set(entries) - files)}"
    for name, digest in entries.items():
        assert hashlib.sha256((RELEASES / name).read_bytes()).hexdigest() == digest, f"{name}: sha256 differs"


def test_released_journals_are_complete_regeneration_journals():
    journals = sorted(RELEASES.glob("data/*/regenerated.jsonl.gz"))
    assert journals, "releases/data holds no journal"
    for journal in journals:
        data = gzip.decompress(journal.read_bytes())
        assert data.endswith(b"\n"), f"{journal}: last line torn"
        conversations = parse_journal(journal, data)
        assert len(conversations) == data.count(b"\n"), f"{journal}: a conversation appears twice"
        for conversation in conversations.values():
            answers = [t for t in conversation.turns if t.role == "assistant"]
            assert answers and all(t.regenerated and t.content.strip() for t in answers), conversation.id
