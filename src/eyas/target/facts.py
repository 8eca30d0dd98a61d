"""What later stages need to know about a target without loading it: the facts a stage directory records."""

from __future__ import annotations

import hashlib
from pathlib import Path

from eyas.manifest import input_record
from eyas.target.fingerprint import sample_mismatch
from eyas.target.layout import text_config


def target_facts(spec: str, config, source: str | None = None) -> dict:
    """The spec, where it resolved (a local directory by its absolute path), the config's SHA-256 and architecture, and
    the text config's model type, layer count, hidden and vocabulary sizes (``num_layers``: its ``num_hidden_layers``)."""
    text = text_config(config)
    return {
        "spec": spec,
        "source": None if source is None else str(Path(source).resolve() if Path(source).is_dir() else source),
        "config_sha256": hashlib.sha256(config.to_json_string().encode()).hexdigest(),
        "architecture": (getattr(config, "architectures", None) or ["?"])[0],
        "model_type": text.model_type,
        "num_layers": int(text.num_hidden_layers),
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
    }


def target_input(facts: dict) -> dict:
    """The target as a manifest input: its spec, identified by its config's SHA-256."""
    return input_record("target", facts["spec"], facts["config_sha256"])


SIZES = ("num_layers", "hidden_size", "vocab_size")


def target_mismatch(recorded: dict, live: dict, identity: bool = True) -> str | None:
    """How target ``live`` differs from the one ``recorded`` (both target facts), or None when it is that target: sizes
    first; then, with ``identity``, the weights (``weights_sha256``, when both sides have it: equal weights are the same
    target wherever it lies and whichever transformers wrote its config; and, where both sides sampled every layer,
    :mod:`eyas.target.fingerprint`'s per-layer digests), else the config's SHA-256."""
    for key in SIZES:  # a size recorded as 0 or missing is unknown, not different
        if recorded.get(key) and live.get(key) and recorded[key] != live[key]:
            return f"{key.replace('_', ' ')} {recorded[key]} there, {live.get(key)} here"
    if not identity:
        return None
    if recorded.get("weights_sha256") and live.get("weights_sha256"):
        if recorded["weights_sha256"] != live["weights_sha256"]:
            return "same sizes but other weights: the embedding, lm_head or final norm differ"
        inside = sample_mismatch(recorded.get("weights_sample"), live.get("weights_sample"))
        if inside is not None:
            return f"same sizes and embedding but other weights in {inside} (a fine-tune, or a merged adapter)"
        return None
    if recorded.get("config_sha256") and recorded["config_sha256"] != live.get("config_sha256"):
        return "same sizes but another config.json"
    return None
