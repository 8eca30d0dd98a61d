"""A DSpark drafter directory in the format vLLM 0.32 serves (``speculative_config={"method": "dspark", "model": DIR,
"num_speculative_tokens": block_size}``), and back.

config.json, as vLLM's qwen3_dspark.py, qwen3_dflash.py and speculative config read it (and DeepSpec's
``Qwen3DSparkModel``): ``architectures: ["Qwen3DSparkModel"]`` (vLLM's registry key, which also makes ``method``
auto-detect as dspark), ``model_type: "qwen3"`` with the Qwen3 shape fields, ``block_size``, ``dflash_config:
{mask_token_id, target_layer_ids}`` with the backbone's layer ids spelt as DFlash's (the output of layer i = eyas id
i + 1) and the eyas ids as ``eagle_aux_hidden_state_layer_ids`` (vLLM takes them first, as they are), the Markov head
(``markov_rank``, ``markov_head_type: "vanilla"``), ``sample_from_anchor: true`` (every slot predicts the token after
it), ``enable_confidence_head`` (with ``confidence_head_with_markov``) as trained, and DeepSpec's own names for what
it requires (``target_layer_ids``, ``mask_token_id``, ``num_anchors``). model.safetensors holds the drafter's
parameters under their names (fc, hidden_norm, layers.i.*, norm, markov_head.markov_w1 / markov_w2,
confidence_head.proj when trained); the target's embedding and lm_head are shared, not written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.export.files import TORCH_DTYPES, safetensors_header, weight_files, write_draft_dir
from eyas.families.dflash.config import ConfigFields, dflash_ids
from eyas.families.dflash.export import dflash_config_json
from eyas.families.dspark.config import ARCHITECTURE, DSparkConfig
from eyas.families.dspark.model import DSparkDrafter

ANCHORS_PER_SAMPLE = 512  # DeepSpec's num_anchors (its loader requires the field; serving does not read it)


def dspark_config_json(config: DSparkConfig, dtype: str, max_position_embeddings: int | None = None) -> dict:
    """The drafter's config.json (its positions: ``max_position_embeddings``, else the config's): the backbone's as a
    DFlash drafter's is written, under DSpark's architecture, with the Markov head and the block's layout."""
    spelt = dflash_ids(config.layer_ids)
    return {
        **dflash_config_json(config, dtype, max_position_embeddings),
        "architectures": [ARCHITECTURE],
        "draft_vocab_size": config.vocab_size,
        "target_layer_ids": spelt,
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head,
        "sample_from_anchor": True,
        "num_anchors": ANCHORS_PER_SAMPLE,
    }


def write_dspark_dir(out: Path, drafter: DSparkDrafter, dtype: str, max_position_embeddings: int | None = None,
                     card: str = "") -> Path:
    """The drafter as a directory vLLM's dspark method loads (config.json, model.safetensors, README.md)."""
    tensors = {name: t.detach().to(TORCH_DTYPES[dtype]).contiguous() for name, t in drafter.state_dict().items()}
    return write_draft_dir(out, dspark_config_json(drafter.config, dtype, max_position_embeddings), tensors, card)


def config_from_json(config: dict, where: str = "config.json") -> DSparkConfig:
    """A DSpark config.json (eyas' or DeepSpec's layout) → DSparkConfig, every field checked (one line naming a field
    of the wrong kind or out of range); the eyas ids from eagle_aux_hidden_state_layer_ids, else the DFlash-spelt
    dflash_config.target_layer_ids or target_layer_ids + 1."""
    field = ConfigFields(config, where, "DSpark", ARCHITECTURE)
    ids = field.layer_ids(top_level_spelling=True)
    if not config.get("sample_from_anchor", True) or config.get("dspark_bonus_anchor", False):
        raise EyasError(f"{where}: sample_from_anchor false (a DFlash-style fill-in block): eyas decodes DSpark's "
                        "anchor-first block only")
    confidence = config.get("enable_confidence_head", False)
    if not isinstance(confidence, bool):
        raise EyasError(f"{where}: enable_confidence_head is {confidence!r}: true or false")
    if confidence and config.get("confidence_head_with_markov") is not True:
        raise EyasError(f"{where}: a confidence head without the Markov embedding (confidence_head_with_markov not "
                        "true): eyas reads DeepSpec's default head, over the slot's state and the Markov embedding")
    if config.get("markov_head_type", "vanilla") != "vanilla":
        raise EyasError(f"{where}: markov_head_type {config.get('markov_head_type')!r}: eyas (and vLLM) read the "
                        "'vanilla' Markov head only")
    hidden, heads = field.whole("hidden_size"), field.whole("num_attention_heads")
    kv_heads = field.whole("num_key_value_heads", heads)
    if heads % kv_heads:
        raise EyasError(f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    vocab = field.whole("vocab_size")
    return DSparkConfig(
        hidden_size=hidden, target_hidden_size=field.whole("target_hidden_size", hidden),
        num_hidden_layers=field.whole("num_hidden_layers"), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=field.whole("head_dim", hidden // heads or None), intermediate_size=field.whole("intermediate_size"),
        vocab_size=vocab, block_size=field.whole("block_size"), mask_token_id=field.mask_token(vocab),
        layer_ids=ids, rms_norm_eps=field.real("rms_norm_eps", 1e-6), rope_theta=field.real("rope_theta", 1e6),
        max_position_embeddings=field.whole("max_position_embeddings", 32768), markov_rank=field.whole("markov_rank"),
        confidence_head=confidence)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The directory's tensors under their own names (a ``model.`` prefix dropped), from safetensors only."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if path.suffix != ".safetensors":
            raise EyasError(f"{path}: a DSpark drafter is read from safetensors only (no pickles)")
        safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 — safe_open is not a dict
                out[name.removeprefix("model.")] = f.get_tensor(name)
    return out


# What vLLM's Qwen3DSpark loader reads beyond the drafter's own parameters, and eyas does not: a checkpoint holding one
# is another drafter (its own embedding or head, a reduced vocabulary), not eyas' layout.
NOT_READ = ("embed_tokens", "lm_head", "d2t", "t2d", "mask_embedding")


def load_dspark_dir(directory: Path, dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """A DSpark drafter directory → the module, every parameter checked against its name and shape."""
    directory = Path(directory)
    config = config_from_json(json.loads((directory / "config.json").read_text()), str(directory / "config.json"))
    drafter = DSparkDrafter(config)
    tensors = {name: t for name, t in read_tensors(directory).items() if not name.startswith(NOT_READ)}
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items() if name in expected}
    missing = sorted(set(expected) - set(found))
    wrong = sorted(n for n in found if found[n] != expected[n])
    if missing or wrong:
        raise EyasError(f"{directory}: not the DSpark drafter its config describes: missing {missing[:4]}, "
                        f"wrong shapes {[(n, found[n], expected[n]) for n in wrong[:4]]}")
    drafter.load_state_dict({name: tensors[name] for name in expected})
    return drafter.to(dtype).eval()


def dspark_problems(directory: Path, config: dict, target=None) -> list[str]:
    """What keeps vLLM's dspark method from serving ``directory`` as this drafter means (``target``: a
    :class:`eyas.export.fit.TargetSizes` the drafter must fit), one line each; [] when it passes."""
    where = f"{Path(directory) / 'config.json'}"
    try:
        parsed = config_from_json(config, where)
    except EyasError as err:
        return [str(err)]
    problems = []
    if "eagle_config" in config:
        problems.append(f"{where}: has eagle_config, which vLLM's runner lets replace dflash_config's layer ids: "
                        "remove it")
    spelt = (config.get("dflash_config") or {}).get("target_layer_ids")
    if spelt is not None and list(spelt) != dflash_ids(parsed.layer_ids):
        problems.append(f"{where}: dflash_config.target_layer_ids {list(spelt)} and eagle_aux_hidden_state_layer_ids "
                        f"{parsed.layer_ids} name different states (DFlash's spelling is eyas ids − 1)")
    if config.get("draft_vocab_size", parsed.vocab_size) != parsed.vocab_size:
        problems.append(f"{where}: draft_vocab_size {config.get('draft_vocab_size')} ≠ vocab_size {parsed.vocab_size}: "
                        "a reduced draft vocabulary needs lm_head and d2t, which eyas does not write")
    if target is not None:
        if parsed.vocab_size != target.vocab_size:
            problems.append(f"made for another target: vocab_size {parsed.vocab_size}, the target has {target.vocab_size}")
        if parsed.target_hidden_size != target.hidden_size:
            problems.append(f"made for another target: target_hidden_size {parsed.target_hidden_size}, the target's "
                            f"hidden size is {target.hidden_size}")
        outside = [i for i in parsed.layer_ids if not 1 <= i <= target.num_layers]
        if outside:
            problems.append(f"layer ids {outside} are outside the target's 1 … {target.num_layers}")
    if problems:
        return problems
    try:
        names = set(read_tensors(directory))
        load_dspark_dir(directory)
    except EyasError as err:
        return [str(err)]
    extra = sorted(name for name in names if name.startswith(NOT_READ))
    if extra:
        problems.append(f"model.safetensors holds {extra[:4]}: eyas' DSpark drafter shares the target's embedding and "
                        "lm_head over its whole vocabulary; a checkpoint with them is another layout")
    if not parsed.confidence_head and any(name.startswith("confidence_head.") for name in names):
        problems.append(f"model.safetensors holds a confidence head but {where} says enable_confidence_head false: "
                        "vLLM would leave it unread")
    return problems
