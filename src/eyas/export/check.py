"""``eyas check DRAFT_DIR``: does a drafter directory satisfy the contract its engines load? Any drafter, of any family:
the family its config.json is of (:func:`eyas.families.of_config`) checks it.

Errors are what makes an engine refuse the directory or silently compute something else; warnings
are what works but deserves a look. Each message says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas import families
from eyas.errors import EyasError
from eyas.export.files import read_draft_config
from eyas.export.fit import TargetSizes, weights_warning


@dataclass
class CheckResult:
    """Problems found; ``ok`` when there is no error."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no error was found."""
        return not self.errors


def check_draft_dir(directory: Path, target: TargetSizes | None = None) -> CheckResult:
    """Validate config.json and model.safetensors of ``directory`` against the export contract (and, given the
    ``target``'s sizes, that the drafter fits it)."""
    directory = Path(directory)
    result = CheckResult()
    try:
        config = read_draft_config(directory)
    except EyasError as err:
        result.errors.append(str(err))
        return result
    families.of_config(config).check(directory, config, target, result)
    return result


def check_for_target(directory: Path, target: str | None, trust_remote_code: bool = False) -> CheckResult:
    """``check_draft_dir``, with the target's sizes read from its config when ``target`` is given."""
    if not target:
        return check_draft_dir(directory)
    from eyas.target.loading import load_target_config

    result = check_draft_dir(directory, TargetSizes.of(load_target_config(target, trust_remote_code)[0]))
    if result.ok:
        other_weights = weights_warning(directory, target, trust_remote_code)
        result.warnings += [other_weights] if other_weights is not None else []
    return result


