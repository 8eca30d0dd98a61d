"""Tiny random-weight targets of many architectures, built from configs (no hub, no files).

Every text stack has 8 decoder layers, so the default taps are (2, 4, 5), and hidden size 64.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

# The vision tower has as many blocks as the text stack, on purpose: layout discovery must not be fooled.
from eyas.target.rehearsal import VisionTower as _VisionTower

LAYERS = 8
HIDDEN = 64
VOCAB = 256
IMAGE_TOKEN = 250

_TEXT = dict(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    pad_token_id=0,
)


def _seeded(build):
    torch.manual_seed(0)
    model = build()
    return model.float().eval()


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(**_TEXT)))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**_TEXT)))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _seeded(lambda: Qwen3ForCausalLM(Qwen3Config(**_TEXT, head_dim=16)))


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return _seeded(lambda: Qwen3MoeForCausalLM(cfg))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return _seeded(lambda: MistralForCausalLM(MistralConfig(**_TEXT, sliding_window=None)))


def gemma3_text():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**_TEXT, head_dim=16, sliding_window=16)
    return _seeded(lambda: Gemma3ForCausalLM(cfg))


def deepseek_v3_config(**overrides):
    """A DeepSeek-V3-shaped config (MLA attention, shared + routed experts), tiny by default."""
    from transformers import DeepseekV3Config

    base = dict(
        _TEXT,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    base.update(overrides)
    return DeepseekV3Config(**base)


def deepseek_v3():
    from transformers import DeepseekV3ForCausalLM

    return _seeded(lambda: DeepseekV3ForCausalLM(deepseek_v3_config()))


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=251,
                           vision_start_token_id=252)
    return _seeded(lambda: Qwen2_5_VLForConditionalGeneration(cfg))


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4)
    cfg = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_TEXT), image_token_index=IMAGE_TOKEN,
                      projector_hidden_act="gelu")
    return _seeded(lambda: LlavaForConditionalGeneration(cfg))


LLAVA_IMAGE_TOKENS = (16 // 4) ** 2  # patches of one 16×16 image; CLS dropped by the 'default' strategy


class KimiStyleConfig(PretrainedConfig):
    """A Kimi-K2.5-shaped wrapper config: DeepSeek-V3 text model plus a vision tower."""

    model_type = "kimi_style_test"

    def __init__(self, text_config=None, **kwargs):
        self.text_config = text_config
        super().__init__(**kwargs)


class KimiStyleForConditionalGeneration(PreTrainedModel):
    """Text stack at ``language_model.model.layers``, as in Kimi-K2.5."""

    config_class = KimiStyleConfig

    def __init__(self, config: KimiStyleConfig):
        from transformers import DeepseekV3ForCausalLM

        super().__init__(config)
        text = config.text_config
        self.vision_tower = _VisionTower(32, text.num_hidden_layers)
        self.mm_projector = nn.Linear(32, text.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(text)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, pixel_values=None, **kwargs):
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            features = self.mm_projector(self.vision_tower(pixel_values)).to(embeds.dtype)
            embeds = embeds.masked_scatter((input_ids == IMAGE_TOKEN).unsqueeze(-1), features)
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, **kwargs)


def kimi_style():
    cfg = KimiStyleConfig(text_config=deepseek_v3_config())
    return _seeded(lambda: KimiStyleForConditionalGeneration(cfg))


# name → (builder, expected decoder-stack path)
ARCHITECTURES = {
    "llama": (llama, "model.layers"),
    "qwen2": (qwen2, "model.layers"),
    "qwen3": (qwen3, "model.layers"),
    "qwen3_moe": (qwen3_moe, "model.layers"),
    "mistral": (mistral, "model.layers"),
    "gemma3_text": (gemma3_text, "model.layers"),
    "deepseek_v3": (deepseek_v3, "model.layers"),
    "qwen2_5_vl": (qwen2_5_vl, "model.language_model.layers"),
    "llava": (llava, "model.language_model.layers"),
    "kimi_style": (kimi_style, "language_model.model.layers"),
}


def save_tiny_target(directory) -> str:
    """A tiny Llama saved as an HF directory (a real target spec for stage commands)."""
    llama().save_pretrained(directory)
    return str(directory)


def save_llama(directory, seed: int = 0, **sizes) -> str:
    """A tiny random Llama saved as an HF directory: :func:`llama`'s sizes (max_position_embeddings 256) unless
    ``sizes`` change them; ``seed`` picks its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0)
    LlamaForCausalLM(LlamaConfig(**{**config, **sizes})).float().save_pretrained(directory)
    return str(directory)


def save_chat_target(directory, num_hidden_layers: int = LAYERS):
    """A random Llama with the demo target's vocabulary and tokenizer (chat template included), saved as
    an HF directory: a real target for prepare, regeneration and whole runs, fast to execute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.loading import load_tokenizer, resolve_target

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(directory)
    load_tokenizer(resolve_target("demo")).save_pretrained(directory)
    return directory


def write_data_dir(directory, sizes=(("train", 24), ("holdout", 4)), seed: int = 0, draft_vocab_size: int = 128,
                   id_digits: int = 0) -> str:
    """A DATA_DIR with random token ids (as `eyas prepare` would write), lengths 5..60; ``id_digits``: sample ids
    zero-padded to that many digits (then the files' order is the ids' order)."""
    import json
    from pathlib import Path

    import numpy as np

    from eyas.data.samples import Sample, write_samples

    directory = Path(directory)
    rng = np.random.default_rng(seed)
    for split, count in sizes:
        samples = []
        for i in range(count):
            length = int(rng.integers(5, 61))
            ids = rng.integers(1, VOCAB, size=length).astype(np.int32)
            mask = (rng.random(length) < 0.6).astype(np.uint8)
            samples.append(Sample(f"{split}-{i:0{id_digits}d}", ids, mask))
        write_samples(samples, directory / f"{split}.parquet")
    from eyas.data.samples import read_samples
    from eyas.data.vocab import build_draft_vocab, count_masked_tokens, save_vocab

    train = read_samples(directory / "train.parquet")
    counts = count_masked_tokens(((s.input_ids, s.loss_mask) for s in train), VOCAB)
    save_vocab(build_draft_vocab(counts, draft_vocab_size), directory / "vocab.safetensors")
    (directory / "manifest.json").write_text(json.dumps({"format": "eyas-data/1", "seed": seed}))
    return str(directory)


def tiny_store(root, sizes=(("train", 32), ("holdout", 6))):
    """A tiny target, its DATA_DIR and an fp32 FEATURES_DIR under ``root``: (target, data, features)."""
    from pathlib import Path

    from eyas.capture.options import CaptureOptions
    from eyas.capture.stage import capture

    root = Path(root)
    target = save_tiny_target(root / "target")
    data = Path(write_data_dir(root / "data", sizes=sizes))
    capture(CaptureOptions(target=target, data=data, out=root / "features", dtype="fp32", token_budget=200, max_batch=4))
    return target, data, root / "features"


def write_tiny_gguf(path, chat_template: str | None = None, layers: int = LAYERS):
    """A tiny random Llama as a float32 GGUF file, with a byte-level BPE tokenizer (259 tokens: the 256 bytes,
    then <|endoftext|>, <|im_start|>, <|im_end|>) and, if given, a chat template. Returns (path, the HF model)."""
    from pathlib import Path

    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    heads, kv_heads, hidden = 4, 2, HIDDEN
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         bos_token_id=257, eos_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(128)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * 3)
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(257)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def permute(w, n):  # llama.cpp's q/k row order (transformers undoes it on load)
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                         ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                         ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            writer.add_tensor(f"blk.{i}.{name}.weight", state[p + hf + ".weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(state[p + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(state[p + "self_attn.k_proj.weight"], kv_heads))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def assert_same_final_weights(run_a: Path, run_b: Path) -> None:
    """Two training runs ended with bit-identical final weights."""
    from safetensors.torch import load_file

    a, b = (load_file(Path(run) / "final" / "model.safetensors") for run in (run_a, run_b))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def free_port() -> str:
    """A port no process listens on now, for torch.distributed.run's --master-port: tests side by side (pytest-xdist
    workers) must not share a rendezvous port."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])
