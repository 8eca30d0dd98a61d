"""What eyas understood about a target, without loading its weights (``eyas inspect``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from eyas.target.gguf_header import gguf_config, read_gguf_header
from eyas.target.layer_ids import default_layer_ids, sglang_spelling, specforge_spelling
from eyas.target.layout import discover_layout, text_config
from eyas.target.loading import (
    build_skeleton,
    default_device,
    default_dtype,
    gguf_file,
    load_target_config,
    load_tokenizer,
)


@dataclass
class TargetDescription:
    """The facts ``eyas inspect`` prints; also returned as JSON with ``--json``."""

    spec: str
    source: str
    architecture: str
    model_type: str
    layers_path: str
    embed_path: str
    norm_path: str
    lm_head_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    parameters: int
    layer_ids: list[int]  # eyas = vLLM meaning
    sglang_layer_ids: list[int] | None
    specforge_layer_ids: list[int]
    chat_template: bool | None  # None: no tokenizer found
    dtype: str
    device_plan: str

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """The (label, value) rows of the table ``eyas inspect`` prints."""
        return [
            ("source", self.source),
            ("architecture", f"{self.architecture} (model_type {self.model_type})"),
            ("decoder layers", f"{self.layers_path}: N = {self.num_layers}"),
            ("hidden size H", str(self.hidden_size)),
            ("vocab", str(self.vocab_size)),
            ("parameters", f"{self.parameters / 1e6:,.1f} M"),
            ("token embedding", self.embed_path),
            ("final norm", self.norm_path),
            ("lm_head", self.lm_head_path),
            ("layer ids (eyas = vLLM)", f"{self.layer_ids}  (input of decoder layer L)"),
            ("  SGLang spelling", str(self.sglang_layer_ids) if self.sglang_layer_ids else "not expressible"),
            ("  SpecForge spelling", f"{self.specforge_layer_ids}  (output of layer L-1)"),
            ("chat template", {True: "present", False: "absent", None: "no tokenizer found"}[self.chat_template]),
            ("dtype", self.dtype),
            ("device plan", self.device_plan),
        ]


def describe_target(spec: str, trust_remote_code: bool = False) -> TargetDescription:
    """Read the config, build the module tree on the meta device, and discover the layout.

    A GGUF target (or ``demo``) is described from its header alone: nothing is converted, dequantized
    or written."""
    config, source, chat_template = _read_config(spec, trust_remote_code)
    skeleton = build_skeleton(config, trust_remote_code)
    layout = discover_layout(skeleton)
    model_type = getattr(text_config(config), "model_type", None) or config.model_type
    ids = default_layer_ids(layout.num_layers)
    params = sum(p.numel() for p in skeleton.parameters())
    device = default_device()
    dtype = default_dtype(device)
    return TargetDescription(
        spec=spec,
        source=source,
        architecture=type(skeleton).__name__,
        model_type=model_type,
        layers_path=layout.layers_path,
        embed_path=layout.embed_path,
        norm_path=layout.norm_path,
        lm_head_path=layout.lm_head_path,
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        vocab_size=layout.vocab_size,
        parameters=params,
        layer_ids=list(ids),
        sglang_layer_ids=_listed(sglang_spelling(ids, model_type, layout.num_layers)),
        specforge_layer_ids=list(specforge_spelling(ids)),
        chat_template=chat_template,
        dtype=str(dtype).removeprefix("torch."),
        device_plan=_device_plan(device, params * torch.finfo(dtype).bits // 8),
    )


def _read_config(spec: str, trust_remote_code: bool):
    """(config, source, chat template present — None when there is no tokenizer), reading no weights."""
    gguf = gguf_file(spec)
    if gguf is not None:
        header = read_gguf_header(gguf)
        return gguf_config(header), str(gguf), header.has_chat_template if header.has_tokenizer else None
    config, source = load_target_config(spec, trust_remote_code)
    tokenizer = load_tokenizer(source, trust_remote_code)
    return config, source, None if tokenizer is None else bool(getattr(tokenizer, "chat_template", None))


def _listed(ids) -> list[int] | None:
    return list(ids) if ids is not None else None


def _device_plan(device: torch.device, weight_bytes: int) -> str:
    size = f"{weight_bytes / 2**30:.2f} GiB of weights"
    if device.type != "cuda":
        return f"cpu ({size})"
    gpus = torch.cuda.device_count()
    free = sum(torch.cuda.mem_get_info(i)[0] for i in range(gpus))
    spread = "1 GPU" if weight_bytes < torch.cuda.mem_get_info(0)[0] * 0.9 else f"up to {gpus} GPUs"
    return f"cuda, device_map='auto' over {spread} ({size}; {free / 2**30:.0f} GiB free on {gpus} GPU(s))"
