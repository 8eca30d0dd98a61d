"""What training the drafter holds in memory: its training state (weights, gradients, AdamW's moments), counted from
its config before it is built, and the activation memory of a training micro-batch, measured without a GPU (the TTT
unroll and its loss on meta tensors)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from eyas.families.eagle3.config import DrafterConfig, drafter_config_from_target

TRAINED_BYTES, FROZEN_BYTES = 16, 4  # per parameter: fp32 weight + gradient + AdamW's two moments; a frozen fp32 weight


class _FusedAttention(torch.autograd.Function):
    """What the GPU's fused attention saves for backward (q, k, v, out, logsumexp, the mask), shapes only: on the meta
    device PyTorch would decompose attention into the math path and keep [B, h, T, S] scores the GPU never writes."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32), mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


@contextmanager
def saved_storages(module: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Within the block: every storage autograd saves for backward, once, by its bytes (``module``'s parameters not
    counted: they exist whether or not a graph is kept). Keep the saved tensors alive until the count is read, so no
    storage is freed and its address reused."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def ttt_saved_bytes(config: DrafterConfig, rows: int, length: int, steps: int) -> int:
    """Bytes autograd keeps for backward over a TTT unroll and its loss at these widths (meta tensors, bf16 as autocast
    computes): the activation memory of a training micro-batch."""
    from eyas.families.eagle3.loss import TargetSignal, step_loss
    from eyas.families.eagle3.model import Eagle3Drafter
    from eyas.families.eagle3.ttt import ttt_steps

    with torch.device("meta"):
        drafter = Eagle3Drafter(config).to(torch.bfloat16)
        aux = torch.empty(rows, length, config.aux_width, dtype=torch.bfloat16)
        ids = torch.zeros(rows, length, dtype=torch.long)
        signal = TargetSignal(torch.empty(rows, length, config.draft_vocab_size), torch.zeros(rows, length, dtype=torch.long),
                              torch.ones(rows, length, dtype=torch.bool))
        mask = torch.ones(rows, length, dtype=torch.uint8)
    def sdpa(q, k, v, attn_mask=None, is_causal=False, **_):
        return _FusedAttention.apply(q, k, v, attn_mask if attn_mask is not None else torch.empty(0, device=q.device))

    with saved_storages(drafter) as saved, mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
        kept = [step_loss(logits, signal, mask, k, compile=False).loss  # the trainer keeps every step's graph
                for k, logits in enumerate(ttt_steps(drafter, aux, ids, steps, attention="concat"))]
    assert len(kept) == steps  # alive until here: no storage is freed and its address reused while counting
    return sum(saved.values())


def parameter_counts(config: DrafterConfig) -> tuple[int, int]:
    """(trained, frozen) parameters of a drafter of ``config`` (:class:`eyas.families.eagle3.model.Eagle3Drafter`'s
    tensors: the token embedding is frozen when the drafter is as wide as the target, whose embedding it reads)."""
    hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    layer = 2 * hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * config.intermediate_size + 3 * hidden
    trained = config.aux_width * hidden + layer + hidden + hidden * config.draft_vocab_size  # fc, layer, norm, lm_head
    trained += config.aux_width if config.fc_norm else 0  # EAGLE-3.1's norm on each target state
    embedding = config.vocab_size * hidden
    owns = hidden != config.target_hidden_size
    return trained + (embedding if owns else 0), 0 if owns else embedding


def state_bytes(config: DrafterConfig) -> int:
    """Bytes a drafter of ``config`` holds while it trains: its fp32 weights, and for each trained one its gradient and
    AdamW's two moments."""
    trained, frozen = parameter_counts(config)
    return TRAINED_BYTES * trained + FROZEN_BYTES * frozen


def least_state_bytes(target_config, layer_ids, hidden_size: int | None) -> int:
    """:func:`state_bytes` of the drafter ``--hidden-size hidden_size`` builds beside a target of HF config
    ``target_config`` with ``layer_ids`` (None: one tap, the fewest), at its least: a draft vocabulary of one token
    (its size comes with the data)."""
    taps = list(layer_ids) if layer_ids else [0]
    return state_bytes(drafter_config_from_target(target_config, taps, 1, hidden_size))


def fitting_width(target_config, options, free: int) -> str:
    """What ``--hidden-size`` to give so that the drafter's training state fits ``free`` bytes: the widest multiple of
    the target's head size that fits (a multiple always builds: :func:`eyas.families.eagle3.config.check_width`), and
    the target's own width when it fits; or that none fits."""
    from eyas.outputs import human_bytes
    from eyas.target.layout import text_config

    cfg = text_config(target_config)
    target_width = int(cfg.hidden_size)
    head = drafter_config_from_target(target_config, [0], 1, target_width + 1).head_dim  # a width not the target's
    heads = _widest_heads(lambda count: least_state_bytes(target_config, options.layer_ids, count * head) <= free,
                          max(1, (options.hidden_size or target_width) // head),
                          max(1, int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)))
    if not heads:
        return (f"no --hidden-size fits (the narrowest, {head}, needs at least "
                f"{human_bytes(least_state_bytes(target_config, options.layer_ids, head))}): train on a device with "
                "more memory, or shard the drafter over several with --fsdp under torchrun")
    own = options.hidden_size is not None and least_state_bytes(target_config, options.layer_ids, None) <= free
    return (f"give --hidden-size {heads * head} or less (a multiple of the target's head size {head})"
            + (f", or leave it out (the target's width, {target_width})" if own else ""))


def _widest_heads(fits, most: int, kv_heads: int) -> int:
    """The most attention heads, up to ``most``, with which the drafter ``fits`` (0: none). A multiple of the target's
    ``kv_heads`` keeps them, and its state grows with the heads: the widest such is found by bisection; a count between
    two multiples takes a key/value head per head (:func:`eyas.families.eagle3.config._attention`), more than the next
    multiple up, so only those below that multiple can fit — tried from the widest down."""
    low, high = 0, most // kv_heads  # low · kv_heads heads fit; high · kv_heads may not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * kv_heads) else (low, middle - 1)
    for count in range(min(most, (low + 1) * kv_heads - 1), low * kv_heads, -1):
        if fits(count):
            return count
    return low * kv_heads
