"""The DSpark drafter's shape (:class:`DSparkConfig`, RUN_DIR's drafter_config.json) and the names that tell its RUN_DIR
and DRAFT_DIR apart from other families'; no torch.

Its backbone is DFlash's (:class:`eyas.families.dflash.config.DFlashConfig`, the same fields and layer-id rules: eyas
ids, DESIGN "Conventions"); it adds the Markov head's rank. ``block_size`` is DSpark's block: B slots, every one a
prediction (the anchor's included), so a block proposes B tokens where DFlash's proposes B − 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from eyas.families.dflash.config import DFlashConfig, dflash_config_from_target, parameter_count

FAMILY_KEY, FAMILY = "drafter", "dspark"  # how a drafter_config.json says which family it describes
ARCHITECTURE = "Qwen3DSparkModel"  # an exported DRAFT_DIR's config.json "architectures" (vLLM's registry key)


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's backbone fields, ``block_size`` the slots a block proposes, the Markov head's rank, and whether the
    drafter has a confidence head."""

    markov_rank: int = 256
    confidence_head: bool = False

    def to_dict(self) -> dict:
        """JSON-ready, with the family named (RUN_DIR's drafter_config.json: ``"drafter": "dspark"``)."""
        return {FAMILY_KEY: FAMILY, **asdict(self)}


def dspark_config_from_target(target_config, layer_ids, block_size: int, draft_layers: int, markov_rank: int,
                              mask_token_id: int | None = None, confidence_head: bool = False) -> DSparkConfig:
    """A drafter as wide as the target's text model (DFlash's rule: its heads, MLP width, norm epsilon, RoPE base and
    mask token) with a Markov head of ``markov_rank`` (and a confidence head when asked)."""
    backbone = dflash_config_from_target(target_config, layer_ids, block_size, draft_layers, mask_token_id)
    return DSparkConfig(**asdict(backbone), markov_rank=int(markov_rank), confidence_head=bool(confidence_head))


def spark_parameter_count(config: DSparkConfig) -> int:
    """Parameters of a drafter of ``config``: the backbone's and the Markov head's two vocabulary × rank matrices (all
    trained; the embedding and lm_head it reads are the target's)."""
    confidence = config.hidden_size + config.markov_rank + 1 if config.confidence_head else 0
    return parameter_count(config) + 2 * config.vocab_size * config.markov_rank + confidence


def least_state_bytes(target_config, layer_ids, draft_layers: int, markov_rank: int) -> int:
    """Bytes the drafter holds while it trains (fp32 weights, gradients and AdamW's two moments: 16 a parameter), at
    its least: ``layer_ids`` (None: one tap)."""
    taps = list(layer_ids) if layer_ids else [0]
    return 16 * spark_parameter_count(dspark_config_from_target(target_config, taps, 1, draft_layers, markov_rank))
