"""The drafter's shape, derived from the target's config (and written into the export's config.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eyas.errors import EyasError


@dataclass
class DrafterConfig:
    """Everything that fixes the drafter's tensors and math."""

    hidden_size: int  # H, the drafter's width
    target_hidden_size: int  # Ht, the width of each captured target state
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # V, the target's vocabulary (token embedding rows)
    draft_vocab_size: int  # Vd, the drafter's lm_head rows
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=dict)  # one flat RoPE (drafter_rope), whatever it is given
    layer_ids: list[int] = field(default_factory=list)  # eyas ids of the aux states, low → high
    hidden_act: str = "silu"
    # speculators-format drafters may add the normed hidden as the residual (vLLM honours it, SGLang
    # does not); eyas trains and exports False, and imports True only to measure such drafters
    norm_before_residual: bool = False
    # EAGLE-3.1 (vLLM and SGLang read both from config.json): an RMSNorm on each target state before fc, and the
    # post-norm output (not the pre-norm one) as the next step's hidden; eyas trains either with --fc-norm/--norm-output
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        self.rope_parameters = drafter_rope(self.rope_parameters)

    @property
    def aux_width(self) -> int:
        """Width of the concatenated aux states fed to fc: k · Ht."""
        return len(self.layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        """Inverse of :meth:`to_dict` (unknown keys ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def llama_config(self):
        """A transformers LlamaConfig with the same attention/MLP/RoPE settings (for RoPE and norms)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), hidden_act=self.hidden_act,
        )


def drafter_rope(rope: dict | None, theta: float = 10000.0) -> dict:
    """The one RoPE the drafter's layer rotates with (training, eyas' engine and the export alike), flat.

    A target with one RoPE per layer type (Gemma 3: sliding layers θ = 1e4, full-attention layers 1e6)
    gives its full-attention one: the drafter's layer attends over the whole context. A per-layer-type
    dict that also carries top-level entries (drafter configs written by earlier eyas) keeps those, which
    are what that drafter was trained with. Engines read a flat dict (SGLang and vLLM hash its values).
    """
    rope = dict(rope or {})
    flat = {key: value for key, value in rope.items() if not isinstance(value, dict)}
    nested = {key: value for key, value in rope.items() if isinstance(value, dict)}
    if nested and not flat:
        flat = dict(nested.get("full_attention") or next(iter(nested.values())))
    flat["rope_type"] = flat.get("rope_type") or flat.pop("type", None) or "default"
    flat["rope_theta"] = float(flat.get("rope_theta") or theta)
    return flat


def drafter_config_from_target(target_config, layer_ids, draft_vocab_size: int, hidden_size: int | None = None,
                               fc_norm: bool = False, norm_output: bool = False) -> DrafterConfig:
    """Attention heads, MLP width, norm epsilon and RoPE (scaling included) follow the target's text config;
    ``fc_norm``, ``norm_output``: EAGLE-3.1's norms (:class:`DrafterConfig`)."""
    from eyas.target.layout import text_config

    cfg = text_config(target_config)
    target_hidden = int(cfg.hidden_size)
    hidden = int(hidden_size or target_hidden)
    heads, kv_heads, head_dim = _attention(cfg, hidden)
    rope = drafter_rope(getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_theta", None) or 10000.0)
    intermediate = int(getattr(cfg, "intermediate_size", 4 * hidden))
    return DrafterConfig(
        hidden_size=hidden, target_hidden_size=target_hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=intermediate if hidden == target_hidden else 4 * hidden,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), vocab_size=int(cfg.vocab_size),
        draft_vocab_size=int(draft_vocab_size), max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        rope_parameters=rope, layer_ids=[int(i) for i in layer_ids], fc_norm=fc_norm, norm_output=norm_output,
    )


def check_width(target_config, hidden_size: int | None) -> None:
    """Refuse, in one line, a ``--hidden-size`` the drafter's attention cannot take beside this target: its heads
    (the width over the target's head size, :func:`_attention`) must divide the width (transformers' LlamaConfig
    refuses it otherwise, in a traceback). A multiple of the head size always builds: the nearest two are named."""
    if hidden_size is None:  # the target's own width: its own heads
        return
    from eyas.target.layout import text_config

    cfg = text_config(target_config)
    heads, _, head_dim = _attention(cfg, int(hidden_size))
    if hidden_size % heads == 0:
        return
    below = hidden_size // head_dim * head_dim  # ≥ head_dim: a width below one head has one head, which divides it
    raise EyasError(f"--hidden-size {hidden_size} cannot build an EAGLE-3 drafter for this target: at that width the "
                    f"drafter keeps the target's head size {head_dim}, so it has {heads} attention heads, which do not "
                    f"divide {hidden_size}; give a multiple of {head_dim}, e.g. --hidden-size {below} or "
                    f"{below + head_dim}, or leave it out (the target's width, {int(cfg.hidden_size)})")


def _attention(cfg, hidden: int) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head size) of a drafter ``hidden`` wide beside the target's text config
    ``cfg``: at the target's width its heads; at another width the target's head size, with as many heads as fit (at
    least one). Key/value heads: the target's when they divide the heads (never more), else one per head."""
    target_hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    # An MLA target (DeepSeek-V3, Kimi-K2.5) reports head_dim = its RoPE part (transformers sets it to
    # qk_rope_head_dim, 64); a drafter head takes the value head's width (128), as SpecForge's Kimi-K2.5 drafter does.
    head_dim = int(getattr(cfg, "v_head_dim", None) or getattr(cfg, "head_dim", None) or target_hidden // heads)
    if hidden != target_hidden:  # a narrower drafter keeps the head size, with fewer heads
        heads = max(1, hidden // head_dim)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    kv_heads = kv_heads if heads % kv_heads == 0 else heads
    return heads, min(kv_heads, heads), head_dim
