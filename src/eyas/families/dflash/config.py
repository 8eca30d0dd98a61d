"""The DFlash drafter's shape (:class:`DFlashConfig`, RUN_DIR's drafter_config.json), the names that tell its RUN_DIR
and DRAFT_DIR apart from other families', and its layer-id rules; no torch.

Layer ids are eyas ids (DESIGN: id L = the residual stream entering decoder layer L); DFlash's own configs count "the
output of layer i", which is eyas id i + 1 (:func:`dflash_ids`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from eyas.errors import EyasError
from eyas.target.layer_ids import from_output_spelling, output_spelling


@dataclass
class DFlashConfig:
    """The drafter's shape; ``layer_ids`` in eyas' meaning, one per tapped target layer."""

    hidden_size: int
    target_hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def to_dict(self) -> dict:
        """JSON-ready, with the family named (RUN_DIR's drafter_config.json: ``"drafter": "dflash"``)."""
        return {FAMILY_KEY: FAMILY, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> DFlashConfig:
        """Inverse of :meth:`to_dict` (unknown keys ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


FAMILY_KEY, FAMILY = "drafter", "dflash"  # how a drafter_config.json says which family it describes (absent: EAGLE-3)
ARCHITECTURE = "DFlashDraftModel"  # an exported DRAFT_DIR's config.json "architectures" (vLLM's registry key)


def dflash_config_from_target(target_config, layer_ids, block_size: int, draft_layers: int,
                              mask_token_id: int | None = None) -> DFlashConfig:
    """A drafter as wide as the target's text model, with its heads, MLP width, norm epsilon and RoPE base; the mask
    token: ``mask_token_id``, else the vocabulary's last id (a padded vocabulary's unused row; otherwise a rare one)."""
    from eyas.target.layout import text_config

    cfg = text_config(target_config)
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    vocab = int(cfg.vocab_size)
    return DFlashConfig(
        hidden_size=hidden, target_hidden_size=hidden, num_hidden_layers=int(draft_layers), num_attention_heads=heads,
        num_key_value_heads=kv_heads if heads % kv_heads == 0 else heads,
        head_dim=int(getattr(cfg, "v_head_dim", None) or getattr(cfg, "head_dim", None) or hidden // heads),
        intermediate_size=int(getattr(cfg, "intermediate_size", 4 * hidden)), vocab_size=vocab,
        block_size=int(block_size), mask_token_id=vocab - 1 if mask_token_id is None else int(mask_token_id),
        layer_ids=[int(i) for i in layer_ids], rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 32768))


def parameter_count(config: DFlashConfig) -> int:
    """Parameters of a drafter of ``config`` (all trained; the embedding and lm_head it reads are the target's)."""
    hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden + 2 * config.head_dim  # q/k/v, o, q/k norms
    layer = attention + 3 * hidden * config.intermediate_size + 2 * hidden  # + the MLP and the two norms
    return len(config.layer_ids) * config.target_hidden_size * hidden + 2 * hidden + config.num_hidden_layers * layer


def least_state_bytes(target_config, layer_ids, draft_layers: int) -> int:
    """Bytes the drafter of ``draft_layers`` layers beside a target of HF config ``target_config`` holds while it trains
    (fp32 weights, gradients and AdamW's two moments: 16 a parameter), at its least: ``layer_ids`` (None: one tap)."""
    taps = list(layer_ids) if layer_ids else [0]
    return 16 * parameter_count(dflash_config_from_target(target_config, taps, 2, draft_layers))


def default_dflash_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The published rule (z-lab, SpecForge, SGLang: one tap per draft layer, evenly spaced over outputs 1 … N − 3;
    one draft layer: the middle), in eyas ids. Qwen3-8B (36 layers), 5 draft layers: outputs [1, 9, 17, 25, 33]."""
    if draft_layers == 1:
        outputs = [target_layers // 2]
    else:
        outputs = [round(1 + i * (target_layers - 4) / (draft_layers - 1)) for i in range(draft_layers)]
    return list(from_output_spelling(outputs))


def dflash_ids(layer_ids: list[int]) -> list[int]:
    """eyas ids → DFlash's ``target_layer_ids`` (the output of layer i = the input of layer i + 1), as a list."""
    return list(output_spelling(layer_ids))


class ConfigFields:
    """A block drafter's config.json read field by field (DFlash's, and every family's built on its backbone): a field
    of the wrong kind or out of range is one line naming it, never a traceback or a later IndexError."""

    def __init__(self, config: dict, where: str, family: str, architecture: str):
        """Refuses a config of another architecture, or whose dflash_config is not an object."""
        self.config, self.where, self.family = config, where, family
        if architecture not in (config.get("architectures") or []):
            raise EyasError(f"{where}: architectures {config.get('architectures')} is not [{architecture!r}]: not a "
                            f"{family} drafter")
        self.flash = config.get("dflash_config") or {}
        if not isinstance(self.flash, dict):
            raise EyasError(f"{where}: dflash_config is {self.flash!r}: an object (mask_token_id, target_layer_ids)")

    def layer_ids(self, top_level_spelling: bool = False) -> list[int]:
        """The eyas ids: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids (DFlash's spelling, the
        output of layer i: + 1) — or, with ``top_level_spelling``, a target_layer_ids beside it."""
        ids = self.config.get("eagle_aux_hidden_state_layer_ids")
        spelt = self.flash.get("target_layer_ids", self.config.get("target_layer_ids") if top_level_spelling else None)
        if ids is None and _whole_numbers(spelt):
            ids = list(from_output_spelling(spelt))
        if not ids or not _whole_numbers(ids):
            raise EyasError(f"{self.where}: a {self.family} config needs its target layer ids "
                            "(eagle_aux_hidden_state_layer_ids, or dflash_config.target_layer_ids): a list of whole "
                            f"numbers, not {ids if ids is not None else spelt!r}")
        return list(ids)

    def whole(self, name: str, default: int | None = None) -> int:
        """``config[name]`` (``default`` when absent or null) as a whole number ≥ 1."""
        value = self.config.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EyasError(f"{self.where}: {name} is {value!r}: a {self.family} drafter needs a whole number ≥ 1")
        return value

    def real(self, name: str, default: float) -> float:
        """``config[name]`` (``default`` when absent) as a positive number."""
        value = self.config.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise EyasError(f"{self.where}: {name} is {value!r}: a {self.family} drafter needs a positive number")
        return float(value)

    def mask_token(self, vocab: int) -> int:
        """The mask token id (dflash_config's, else the config's own), which must name a row of the vocabulary."""
        mask = self.flash.get("mask_token_id", self.config.get("mask_token_id"))
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
            raise EyasError(f"{self.where}: mask_token_id {mask!r} is outside the vocabulary (0 … {vocab - 1}): a "
                            "block's mask slots embed that token")
        return mask


def _whole_numbers(ids) -> bool:
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
