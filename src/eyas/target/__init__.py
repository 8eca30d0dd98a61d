"""The target model: loading (hub/dir/gguf/demo), layout discovery, hidden-state capture."""

from eyas.target.capture import CapturedStates, capture_hidden_states
from eyas.target.layer_ids import default_layer_ids, sglang_spelling, specforge_spelling, validate_layer_ids
from eyas.target.layout import TargetLayout, discover_layout
from eyas.target.loaded import Target
from eyas.target.loading import load_target, resolve_target

__all__ = [
    "CapturedStates",
    "Target",
    "TargetLayout",
    "capture_hidden_states",
    "default_layer_ids",
    "discover_layout",
    "load_target",
    "resolve_target",
    "sglang_spelling",
    "specforge_spelling",
    "validate_layer_ids",
]
