"""Does a drafter directory fit a target? The one rule ``eyas check --target``, ``eyas bench`` and ``eyas generate``
apply, from the drafter's config.json and the target's config alone — before any weight is loaded.

A drafter fits when it reads target states as wide as the target's hidden size, speaks the target's vocabulary, and
taps layers the target has. A drafter made for another target fails here in one line instead of deep inside a matmul
(or, worse, drafting nonsense that is then rejected token by token).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.target.layer_ids import LayerIdError, resolve_layer_ids, validate_layer_ids


@dataclass(frozen=True)
class TargetSizes:
    """What a drafter must agree with: the target's text model type, layer count, hidden and vocabulary sizes."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, config) -> TargetSizes:
        """The sizes of a target's (HF) config; its text config for multimodal wrappers."""
        from eyas.target.layout import text_config

        text = text_config(config)
        return cls(text.model_type, int(text.num_hidden_layers), int(text.hidden_size), int(getattr(text, "vocab_size", 0)))


def layer_ids_of(config: dict) -> list[int] | None:
    """The layer ids a drafter config names, as vLLM reads them (top level, else eagle_config's); None: engine defaults."""
    nested = config.get("eagle_config")
    nested = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    return config.get("eagle_aux_hidden_state_layer_ids") or nested


def fit_problems(config: dict, target: TargetSizes) -> list[str]:
    """Why a drafter ``config`` (config.json as its family's :meth:`~eyas.families.Family.fit_config` reads it: the
    width of the states it reads, its vocabulary, its layer ids) cannot serve ``target``; [] when it fits."""
    problems = []
    width = config.get("target_hidden_size") or config.get("hidden_size")
    if isinstance(width, int) and width != target.hidden_size:
        problems.append(f"it reads target states {width} wide (target_hidden_size, else hidden_size), and the target's "
                        f"hidden size is {target.hidden_size}")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and target.vocab_size and vocab != target.vocab_size:
        problems.append(f"its vocab_size is {vocab}, the target's {target.vocab_size}: their token ids do not match")
    ids = layer_ids_of(config)
    try:
        if ids is None:
            resolve_layer_ids(None, target.num_layers)  # the engines' defaults, which a shallow target lacks
        else:
            validate_layer_ids(ids, target.num_layers)  # as named: an empty list is a problem, not the defaults
    except LayerIdError as err:
        problems.append(f"it names no layer ids, so the engines tap (2, N//2, N-3), which a {target.num_layers}-layer "
                        "target does not have" if ids is None else f"its {err}")
    return problems


def require_fit(draft_dir: Path | None, target_spec: str, trust_remote_code: bool = False) -> None:
    """Before a target is loaded to decode with ``draft_dir``: its weight files intact and the drafter made for a target
    of this shape, or one line naming the directory and what to do (nothing to check without a drafter)."""
    if draft_dir is None:
        return
    from eyas import families
    from eyas.export.files import integrity_problems, read_draft_config
    from eyas.target.loading import load_target_config

    draft_dir = Path(draft_dir)
    damaged = integrity_problems(draft_dir)
    if damaged:
        more = f" (and {len(damaged) - 1} more; eyas check {draft_dir} lists them)" if len(damaged) > 1 else ""
        raise EyasError(f"{damaged[0]}{more}")
    raw = read_draft_config(draft_dir)
    try:
        config = families.of_config(raw).fit_config(raw)
    except EyasError as err:  # a field its family cannot read
        raise EyasError(f"{draft_dir / 'config.json'}: {err}; export the drafter again (eyas export RUN_DIR --out "
                        f"{draft_dir}), or mend the field") from None
    problems = fit_problems(config, TargetSizes.of(load_target_config(target_spec, trust_remote_code)[0]))
    if problems:
        raise EyasError(f"{draft_dir / 'config.json'}: the drafter was made for another target than {target_spec!r}: "
                        f"{'; '.join(problems)}; use a drafter trained for this target (eyas train --target {target_spec})")
    other_weights = weights_warning(draft_dir, target_spec, trust_remote_code)
    if other_weights is not None:
        print(f"warning: {other_weights}", file=sys.stderr, flush=True)


def weights_warning(draft_dir: Path, target_spec: str, trust_remote_code: bool = False) -> str | None:
    """When the DRAFT_DIR's manifest records the weights of the target the drafter was trained against
    (:mod:`eyas.target.fingerprint`) and ``target_spec``'s differ — a sibling of the same shape: a fine-tune, the base
    model of an instruct target — what to say: it decodes losslessly, but it drafts for another model's answers.
    None when they agree or either side cannot tell (a drafter eyas did not export, a target that is not safetensors)."""
    from eyas.manifest import read_manifest
    from eyas.target.facts import target_mismatch
    from eyas.target.fingerprint import FINGERPRINTS, weights_fingerprint

    try:
        recorded = (read_manifest(draft_dir) or {}).get("target") or {}
    except (OSError, ValueError):
        return None  # a damaged manifest is the integrity check's to report
    if not isinstance(recorded, dict) or not recorded.get("weights_sha256"):
        return None
    live = weights_fingerprint(target_spec, trust_remote_code)
    mismatch = target_mismatch({key: recorded.get(key) for key in FINGERPRINTS}, live)
    if mismatch is None:
        return None
    return (f"{Path(draft_dir) / 'manifest.json'}: the drafter was trained against {recorded.get('spec')!r}, whose "
            f"weights are not --target {target_spec!r}'s ({mismatch}); decoding stays lossless but may accept fewer "
            f"tokens: train a drafter for this target (eyas train --target {target_spec}) for full speed")
