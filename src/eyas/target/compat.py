"""What differs between the transformers releases eyas supports (5.16 and later), in one place."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def cache_keyword(model: nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x, old name deprecated): use the model's own
    name, or for wrappers that only pass ``**kwargs`` on, the installed library's."""
    from transformers.models.llama.modeling_llama import LlamaModel

    for params in (inspect.signature(model.forward).parameters, inspect.signature(LlamaModel.forward).parameters):
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return "past_key_values"
