"""Find the four parts of a target that EAGLE-3 touches, in any HF causal LM or wrapper.

The rule, instead of a per-model table: the token embedding and the lm_head are what the model
itself reports (``get_input_embeddings`` / ``get_output_embeddings``); the decoder stack is
the ``ModuleList`` with as many entries as the text config has layers — and when a vision or
audio tower has a list of the same length, the one that sits beside the token embedding (the
text model owns both); the final norm is the norm-like module registered after that stack in
the same parent. This covers ``model.layers`` (Llama, Qwen, DeepSeek, Gemma),
``model.language_model.layers`` (HF multimodal models) and ``language_model.model.layers``
(Kimi-K2.5) alike, dense, MoE and MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from eyas.errors import LayoutError


@dataclass(frozen=True)
class TargetLayout:
    """Where the decoder stack, token embedding, final norm and lm_head of a target live."""

    layers_path: str
    layers: nn.ModuleList
    embed_path: str
    embed: nn.Module
    norm_path: str
    norm: nn.Module
    lm_head_path: str
    lm_head: nn.Module
    num_layers: int
    hidden_size: int
    vocab_size: int


def text_config(config):
    """The decoder's config: the text sub-config of a multimodal config, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    sub = getter(decoder=True) if getter is not None else None
    return sub if sub is not None else getattr(config, "text_config", config)


def discover_layout(model: nn.Module) -> TargetLayout:
    """Locate the decoder stack, embedding, final norm and lm_head of ``model`` by rule."""
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    embed = _reported(model, "get_input_embeddings")
    lm_head = _reported(model, "get_output_embeddings")
    cfg = text_config(getattr(model, "config", None))
    num_layers = getattr(cfg, "num_hidden_layers", None)

    stacks = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    layers_path, layers = _pick_stack(model, stacks, embed, num_layers, names, lm_head)
    parent_path, _, attr = layers_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    norm_name, norm = _final_norm(parent, attr)
    if norm is None:
        children = ", ".join(f"{n} ({type(m).__name__})" for n, m in parent.named_children())
        raise LayoutError(
            f"found the decoder stack at {layers_path!r} but no final norm beside it; "
            f"children of {parent_path or 'the model'!r}: {children}"
        )
    if lm_head is None:
        raise LayoutError(
            f"found the decoder stack at {layers_path!r} but the model reports no lm_head "
            f"(get_output_embeddings() is None); this looks like a base model, not a causal LM: "
            "load it with its *ForCausalLM / *ForConditionalGeneration class"
        )
    hidden_size = getattr(cfg, "hidden_size", None) or getattr(lm_head, "in_features", None)
    vocab_size = getattr(lm_head, "out_features", None) or getattr(cfg, "vocab_size", None)
    return TargetLayout(
        layers_path=layers_path,
        layers=layers,
        embed_path=names.get(id(embed), "?"),
        embed=embed,
        norm_path=f"{parent_path}.{norm_name}" if parent_path else norm_name,
        norm=norm,
        lm_head_path=names.get(id(lm_head), "?"),
        lm_head=lm_head,
        num_layers=len(layers),
        hidden_size=int(hidden_size),
        vocab_size=int(vocab_size),
    )


def _reported(model: nn.Module, getter: str) -> nn.Module | None:
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None


def _pick_stack(model, stacks, embed, num_layers, names, lm_head):
    if num_layers is not None:
        sized = [(n, m) for n, m in stacks if len(m) == num_layers]
    else:  # no config: the longest lists are the only candidates
        longest = max((len(m) for _, m in stacks), default=0)
        sized = [(n, m) for n, m in stacks if len(m) == longest]
    beside_embed = [(n, m) for n, m in sized if embed is not None and _parent_owns(model, n, embed)]
    for candidates in (beside_embed, sized):
        if len(candidates) == 1:
            return candidates[0]
    found = "; ".join(f"{n} ({len(m)} × {type(m[0]).__name__})" for n, m in stacks) or "no ModuleList at all"
    want = f"{num_layers} entries (num_hidden_layers)" if num_layers is not None else "the longest list"
    raise LayoutError(
        f"cannot tell which ModuleList of {type(model).__name__} is the decoder stack: wanted {want}, "
        f"preferably beside the token embedding ({names.get(id(embed), 'none reported')}); "
        f"found: {found}; lm_head: {names.get(id(lm_head), 'none reported')}"
    )


def _parent_owns(model: nn.Module, path: str, module: nn.Module) -> bool:
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    return any(child is module for child in parent.children())


def _final_norm(parent: nn.Module, stack_attr: str) -> tuple[str, nn.Module | None]:
    """The first norm-like child registered after the stack (the order models build them in);
    failing that, the parent's only norm-like child (some models register it first)."""
    seen_stack = False
    before: list[tuple[str, nn.Module]] = []
    for name, child in parent.named_children():
        if name == stack_attr:
            seen_stack = True
        elif "norm" in type(child).__name__.lower() or "norm" in name.lower() or name == "ln_f":
            if seen_stack:
                return name, child
            before.append((name, child))
    return before[0] if len(before) == 1 else ("", None)
