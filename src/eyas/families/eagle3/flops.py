"""Model FLOPs of the drafter's training: what MFU divides by the step time and the GPU's peak.

Per token of a sequence of T tokens, with H the drafter width, h·d the attention width (q), kv·d the key/value
width, I the MLP width, Vd the draft vocabulary, k·Ht the aux width, K the TTT steps:

    fc          = 2 · (k·Ht) · H                                   once (step 0)
    layer       = 2 · [2H · (h·d + 2·kv·d) + h·d · H + 3 · H · I]  each step (q/k/v read 2H, o_proj, SwiGLU)
    head        = 2 · H · Vd                                       each step (lm_head over the draft vocabulary)
    attention_k = 4 · h·d · (T + k)                                step k: QKᵀ and AV over the T real keys (counted
                                                                   unmasked, as the dense kernels run them) + k own keys
    forward     = fc + K · (layer + head) + Σ_k attention_k
    training    = 3 · (forward − fc) + 2 · fc                      backward is twice the forward, except fc, whose input
                                                                   (the target's states) needs no gradient
The frozen embedding lookup costs no FLOPs; norms, RoPE and the loss's elementwise work are not counted (model
FLOPs, as MFU counts them). The teacher (the target's lm_head, 2 · Ht · V per token, no gradient) is reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.families.eagle3.config import DrafterConfig

H200_BF16_DENSE = 989e12  # FLOP/s: the H200 SXM's dense bf16 peak (NVIDIA's datasheet, the H100's rate)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training micro-batch, by part."""

    fc: float
    layers: float
    heads: float
    attention_real: float  # the T real keys of every step
    attention_own: float  # the k own keys of step k
    teacher: float

    @property
    def forward(self) -> float:
        """The drafter's forward over all TTT steps."""
        return self.fc + self.layers + self.heads + self.attention_real + self.attention_own

    @property
    def training(self) -> float:
        """Forward and backward of the drafter (the teacher excluded)."""
        return 3 * (self.forward - self.fc) + 2 * self.fc


def training_flops(config: DrafterConfig, lengths: list[int], ttt_steps: int) -> StepFlops:
    """Model FLOPs of one micro-batch of sequences of ``lengths`` tokens (each row attends only to itself)."""
    hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    tokens = sum(lengths)
    layer = 2 * (2 * hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * config.intermediate_size)
    steps = range(ttt_steps)
    return StepFlops(
        fc=2.0 * config.aux_width * hidden * tokens,
        layers=float(layer * tokens * ttt_steps),
        heads=2.0 * hidden * config.draft_vocab_size * tokens * ttt_steps,
        attention_real=float(sum(4 * q_width * t * t for t in lengths) * ttt_steps),
        attention_own=float(sum(4 * q_width * t * k for t in lengths for k in steps)),
        teacher=2.0 * config.target_hidden_size * config.vocab_size * tokens,
    )


def mfu(flops: float, seconds: float, peak: float = H200_BF16_DENSE) -> float:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` over ``peak`` FLOP/s."""
    return flops / seconds / peak
