"""What every drafter family's model card (README.md of a DRAFT_DIR) shares: the target as an engine is told it, and
the measured acceptance as text. Each family writes its own card (``families/<name>/card.py``)."""

from __future__ import annotations

from pathlib import Path


def serve_target(facts: dict) -> tuple[str, str | None]:
    """The target as a serving engine must be given it, and a note when it is not the spec: a hub id as is, a local HF
    directory by its absolute path, a GGUF (or ``demo``) by the HF directory eyas converted it into; a placeholder
    ``<...>`` when that directory is gone."""
    spec = facts["spec"]
    source = facts.get("source") or spec
    converted = spec == "demo" or spec.endswith(".gguf")
    local = Path(source).expanduser()
    if (local / "config.json").is_file():
        note = f"`{spec}` is served as the HF directory eyas converted it into" if converted else None
        return str(local.resolve()), note
    if not converted and source == spec and not local.is_absolute():  # resolve_target leaves only hub ids as given
        return spec, None
    if converted:
        return (f"<HF directory converted from {spec}>", f"eyas converted `{spec}` into `{source}`, which is gone: any eyas "
                f"command that loads `{spec}` converts it again (into the eyas cache); put that directory in its place")
    return f"<HF directory of {spec}>", f"the target directory `{source}` is gone: put where it now lies in its place"


def acceptance(evaluation: dict) -> str:
    """The cumulative acceptance per draft position, or that none was evaluated."""
    return ", ".join(f"{a:.3f}" for a in evaluation.get("acceptance_cumulative", [])) or "not evaluated"


def tau(evaluation: dict, key: str) -> str:
    """``evaluation[key]`` (a simulated τ) to two places, or that none was evaluated."""
    return f"{evaluation[key]:.2f}" if key in evaluation else "not evaluated"
