"""What a loaded target is: the model, its tokenizer and its layout, however it was loaded.

:func:`eyas.target.loading.load_target` builds one from a target spec, :func:`eyas.target.rehearsal.loaded_target`
from a model built in memory; both name it from here, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from eyas.target.layout import TargetLayout


@dataclass
class Target:
    """A loaded target: the model, its tokenizer (None if it has none) and its layout."""

    model: nn.Module
    tokenizer: Any
    layout: TargetLayout
    spec: str
    source: str  # the directory or hub id that was loaded
