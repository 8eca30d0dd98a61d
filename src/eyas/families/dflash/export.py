"""A DFlash drafter directory in the format vLLM 0.32 serves (``speculative_config={"method": "dflash", "model": DIR,
"num_speculative_tokens": block_size − 1}``), and back.

config.json (read by vLLM's qwen3_dflash.py and speculative config, and by the published DFlash readers):
``architectures: ["DFlashDraftModel"]`` (vLLM's registry key), ``model_type: "qwen3"`` with the Qwen3 shape fields,
``block_size``, ``dflash_config: {mask_token_id, target_layer_ids}`` with DFlash's layer ids (the output of layer
i = eyas id i + 1), and the eyas ids as ``eagle_aux_hidden_state_layer_ids``, which vLLM takes first and as they are.
No ``eagle_config``: vLLM's runner lets one replace the DFlash ids. model.safetensors holds the drafter's own
parameters under their names (fc, hidden_norm, layers.i.*, norm); the target's embedding and lm_head are shared, so
they are not written (vLLM then uses the target's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.export.files import TORCH_DTYPES, safetensors_header, torch_dtype_name, weight_files, write_draft_dir
from eyas.families.dflash.config import ARCHITECTURE, ConfigFields, DFlashConfig, dflash_ids
from eyas.families.dflash.model import DFlashDrafter


def dflash_config_json(config: DFlashConfig, dtype: str, max_position_embeddings: int | None = None) -> dict:
    """The drafter's config.json (its positions: ``max_position_embeddings``, else the config's)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": max_position_embeddings or config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype_name(dtype),
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": dflash_ids(config.layer_ids)},
        "eagle_aux_hidden_state_layer_ids": list(config.layer_ids),
    }


def write_dflash_dir(out: Path, drafter: DFlashDrafter, dtype: str, max_position_embeddings: int | None = None,
                     card: str = "") -> Path:
    """The drafter as a directory vLLM's dflash method loads (config.json, model.safetensors, README.md)."""
    tensors = {name: t.detach().to(TORCH_DTYPES[dtype]).contiguous() for name, t in drafter.state_dict().items()}
    return write_draft_dir(out, dflash_config_json(drafter.config, dtype, max_position_embeddings), tensors, card)


def config_from_json(config: dict, where: str = "config.json") -> DFlashConfig:
    """A DFlash config.json (eyas' or the published layout) → DFlashConfig, every field checked (one line naming a
    field of the wrong kind or out of range); the eyas ids from eagle_aux_hidden_state_layer_ids, else DFlash's
    target_layer_ids + 1."""
    field = ConfigFields(config, where, "DFlash", ARCHITECTURE)
    hidden, heads, vocab = field.whole("hidden_size"), field.whole("num_attention_heads"), field.whole("vocab_size")
    return DFlashConfig(
        hidden_size=hidden, target_hidden_size=field.whole("target_hidden_size", hidden),
        num_hidden_layers=field.whole("num_hidden_layers"), num_attention_heads=heads,
        num_key_value_heads=field.whole("num_key_value_heads", heads), head_dim=field.whole("head_dim", hidden // heads or None),
        intermediate_size=field.whole("intermediate_size"), vocab_size=vocab, block_size=field.whole("block_size"),
        mask_token_id=field.mask_token(vocab), layer_ids=field.layer_ids(), rms_norm_eps=field.real("rms_norm_eps", 1e-6),
        rope_theta=field.real("rope_theta", 1_000_000.0),
        max_position_embeddings=field.whole("max_position_embeddings", 32768))


def load_dflash_dir(directory: Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A DFlash drafter directory → the module, every parameter checked against its name and shape."""
    import json

    directory = Path(directory)
    config = config_from_json(json.loads((directory / "config.json").read_text()), str(directory / "config.json"))
    drafter = DFlashDrafter(config)
    tensors = _read_raw(directory)
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items() if name in expected}
    missing = sorted(set(expected) - set(found))
    wrong = sorted(n for n in found if found[n] != expected[n])
    if missing or wrong:
        raise EyasError(f"{directory}: not the DFlash drafter its config describes: missing {missing[:4]}, "
                        f"wrong shapes {[(n, found[n], expected[n]) for n in wrong[:4]]}")
    drafter.load_state_dict({name: tensors[name] for name in expected})
    return drafter.to(dtype).eval()


def _read_raw(directory: Path) -> dict[str, torch.Tensor]:
    """The directory's tensors under their own names (a ``model.`` prefix dropped): DFlash's ``layers.i`` are not
    EAGLE-3's single ``midlayer`` (:func:`eyas.export.files.eyas_name` would rename layer 0)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if path.suffix != ".safetensors":
            raise EyasError(f"{path}: a DFlash drafter is read from safetensors only (no pickles)")
        safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 — safe_open is not a dict
                out[name.removeprefix("model.")] = f.get_tensor(name)
    return out


def dflash_problems(directory: Path, config: dict, target=None) -> list[str]:
    """What keeps vLLM's dflash method from serving ``directory`` as this drafter means (``target``: a
    :class:`eyas.export.fit.TargetSizes` the drafter must fit), one line each; [] when it passes."""
    problems = []
    where = f"{Path(directory) / 'config.json'}"
    try:
        parsed = config_from_json(config, where)
    except EyasError as err:
        return [str(err)]
    if "eagle_config" in config:
        problems.append(f"{where}: has eagle_config, which vLLM's runner lets replace dflash_config's layer ids: "
                        "remove it")
    flash_ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if flash_ids is not None and list(flash_ids) != dflash_ids(parsed.layer_ids):
        problems.append(f"{where}: dflash_config.target_layer_ids {list(flash_ids)} and eagle_aux_hidden_state_layer_ids "
                        f"{parsed.layer_ids} name different states (DFlash's ids are eyas ids − 1)")
    if parsed.block_size < 2:
        problems.append(f"{where}: block_size {parsed.block_size}: a block needs its anchor and at least one mask slot")
    if target is not None:
        if parsed.vocab_size != target.vocab_size:
            problems.append(f"made for another target: vocab_size {parsed.vocab_size}, the target has {target.vocab_size}")
        if parsed.target_hidden_size != target.hidden_size:
            problems.append(f"made for another target: target_hidden_size {parsed.target_hidden_size}, the target's hidden "
                            f"size is {target.hidden_size}")
        outside = [i for i in parsed.layer_ids if not 1 <= i <= target.num_layers]
        if outside:
            problems.append(f"layer ids {outside} are outside the target's 1 … {target.num_layers}")
    if problems:
        return problems
    try:
        names = set(_read_raw(directory))
        load_dflash_dir(directory)
    except EyasError as err:
        return [str(err)]
    if "mask_hidden" in names:
        problems.append("model.safetensors holds mask_hidden, which vLLM's DFlash loader refuses (masks are embedded "
                        "through mask_token_id)")
    return problems
