"""A random-weight target with Kimi-K2.5's text widths, wrapped as Kimi-K2.5 wraps its language model.

What issue 23's rehearsal runs capture and training against on one GPU: examples/kimi-k2.5/config.json's
text stack (61 layers, hidden 7168, MLA q/kv LoRA 1536/512, head dims 128 + 64 / 128, 64 heads, vocab
163,840, layer 0 dense, shared + routed experts) with few routed experts so that bf16 weights fit one
H200, under a wrapper whose decoder stack sits at ``language_model.model.layers`` beside a vision tower
with as many blocks (what layout discovery must see through). ``reduced=True`` keeps every structural
choice (61 layers, MLA, layer 0 dense, 8 routed experts of which 8 are active, one shared, the wrapper)
at tiny widths, for the CPU.

Memory at full widths, bf16 (routed experts E, each 3·7168·2048 = 44.0 M parameters):
  per layer: MLA 101.0 M (q_a 11.0, q_b 18.9, kv_a 4.1, kv_b 8.4, o 58.7) + MLP;
  layer 0: dense MLP 3·7168·18432 = 396.4 M; layers 1..60: (E + 1 shared) · 44.0 M + router 7168·E;
  embedding + lm_head 2 · 163840 · 7168 = 2.35 G.
  E = 8: 60 · 497.6 M + 497.4 M + 2.35 G = 32.7 G parameters = 65.4 GB, 75 GB of the H200 left for
  capture batches or an online drafter (~21 GB, benchmarks/kimi_scale.py); E = 16 would be 109 GB.
With all 8 routed experts active (top-8 of 8) a token runs 8 routed + 1 shared expert per layer, the
same matmul work per token as Kimi-K2.5 itself (top-8 of 384 + 1 shared).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, PretrainedConfig, PreTrainedModel

MODEL_TYPE = "eyas_kimi_k25_rehearsal"
ROUTED_EXPERTS = 8

_FULL = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_REDUCED = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def kimi_text_config(reduced: bool = False, routed_experts: int = ROUTED_EXPERTS) -> DeepseekV3Config:
    """Kimi-K2.5's text config (examples/kimi-k2.5/config.json) with ``routed_experts`` routed experts, all active."""
    return DeepseekV3Config(
        **(_REDUCED if reduced else _FULL), num_hidden_layers=61, first_k_dense_replace=1, n_shared_experts=1,
        n_routed_experts=routed_experts, num_experts_per_tok=routed_experts, n_group=1, topk_group=1,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827,
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144,
        tie_word_embeddings=False, bos_token_id=1 if reduced else 163584, eos_token_id=2 if reduced else 163585,
        pad_token_id=0 if reduced else 163839, attn_implementation="sdpa")


class RehearsalConfig(PretrainedConfig):
    """The wrapper's config: a DeepSeek-V3 ``text_config`` and the vision tower's width."""

    model_type = MODEL_TYPE
    sub_configs = {"text_config": DeepseekV3Config}

    def __init__(self, text_config=None, vision_hidden_size: int = 32, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else kimi_text_config(reduced=True)
        self.vision_hidden_size = vision_hidden_size
        kwargs.setdefault("architectures", ["RehearsalForConditionalGeneration"])
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class VisionTower(nn.Module):
    """A small tower with as many blocks as the text stack: layout discovery must pick the text one."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.patch = nn.Linear(12, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))  # named like the text stack, too
        self.norm = nn.LayerNorm(width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.patch(pixels)
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
        return self.norm(hidden)


class RehearsalForConditionalGeneration(PreTrainedModel):
    """``vision_tower``, ``mm_projector`` and ``language_model`` (a DeepseekV3ForCausalLM), as Kimi-K2.5 names them."""

    config_class = RehearsalConfig
    base_model_prefix = ""
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: RehearsalConfig):
        from transformers import DeepseekV3ForCausalLM

        super().__init__(config)
        text = config.text_config
        self.vision_tower = VisionTower(config.vision_hidden_size, text.num_hidden_layers)
        self.mm_projector = nn.Linear(config.vision_hidden_size, text.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(text)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_token_id: int | None = None,
                use_cache: bool = False, logits_to_keep: int = 0, **kwargs):
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None and image_token_id is not None:
            features = self.mm_projector(self.vision_tower(pixel_values)).to(embeds.dtype)
            embeds = embeds.masked_scatter((input_ids == image_token_id).unsqueeze(-1), features)
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, **kwargs)


def register_rehearsal_target() -> None:
    """Make transformers' auto classes know the rehearsal target (its config and model, by :data:`MODEL_TYPE`), so that
    its head directories (:func:`save_head_dir`) load like any target's; :func:`eyas.target.loading.load_target_config`
    calls it. Registering again changes nothing."""
    AutoConfig.register(MODEL_TYPE, RehearsalConfig, exist_ok=True)
    AutoModelForCausalLM.register(RehearsalConfig, RehearsalForConditionalGeneration, exist_ok=True)


def build_rehearsal_target(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                           reduced: bool = False, routed_experts: int = ROUTED_EXPERTS) -> RehearsalForConditionalGeneration:
    """The rehearsal target built directly on ``device`` in ``dtype`` (no host copy), weights fixed by ``seed``."""
    config = RehearsalConfig(text_config=kimi_text_config(reduced, routed_experts))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # every parameter is created in dtype where it lives (the router stays fp32)
    try:
        with torch.device(device):
            model = RehearsalForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    seeded_init(model, seed)
    return model.eval()


def seeded_init(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Matrices ~ N(0, std) from one generator on the model's device (parameters in registration order), norm
    weights 1, biases 0: the same weights for the same seed, device and PyTorch whatever transformers initialises."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, std, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def save_head_dir(model: RehearsalForConditionalGeneration, directory) -> str:
    """Write what later stages read of the target without loading it (config.json; the token embedding, lm_head and
    final norm in model.safetensors, 4.7 GB at full widths instead of 65 GB); returns it as a target spec. Capture and
    online training take the model itself (``loaded``): the directory lacks the decoder layers."""
    from pathlib import Path

    from safetensors.torch import save_file

    from eyas.target.layout import discover_layout

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    layout = discover_layout(model)
    tensors = {f"{layout.embed_path}.weight": layout.embed.weight, f"{layout.lm_head_path}.weight": layout.lm_head.weight,
               **{f"{layout.norm_path}.{name}": t for name, t in layout.norm.state_dict().items()}}
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    return str(directory)


def loaded_target(model: nn.Module, spec: str):
    """``model`` as the :class:`eyas.target.Target` that capture and online training take as ``loaded``."""
    from eyas.target.layout import discover_layout
    from eyas.target.loaded import Target

    return Target(model=model, tokenizer=None, layout=discover_layout(model), spec=spec, source=spec)
