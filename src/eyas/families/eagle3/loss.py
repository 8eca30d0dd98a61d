"""The EAGLE-3 loss: soft cross-entropy to the target's distribution over the draft vocabulary.

The teacher is the target itself: its logits are ``lm_head(final)``, computed here from the stored
final hidden through the lm_head rows of the draft vocabulary only (in token chunks, never a full
[T, V] float32 tensor), renormalised over the draft vocabulary. A position counts when the token it
predicts is an assistant token (loss mask) and the target's own top choice is in the draft vocabulary
(otherwise no draft could be right there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from eyas.compiling import compiled
from eyas.families.eagle3.ttt import shift_left
from eyas.sampling import sampling_probs

log = logging.getLogger(__name__)


@dataclass
class TargetSignal:
    """The target's view of every position: draft-vocabulary probabilities, top draft id, top-in-draft flag."""

    probs: torch.Tensor  # float32 [B, T, Vd]
    argmax: torch.Tensor  # [B, T] draft ids
    in_draft: torch.Tensor  # [B, T] bool: the target's argmax over the full vocabulary is a draft token
    # float32 [B, T], asked for by the LK objectives: the target's probability of the draft vocabulary (probs · mass: the
    # target's own probabilities of the draft tokens); None otherwise (it costs a float32 pass over the whole vocabulary)
    mass: torch.Tensor | None = None
    # per temperature asked for: the target's sampling distribution softmax(logits / T) over the full vocabulary, read
    # at the draft tokens [B, T, Vd] (what a drawn draft can match; it sums to less than 1 where mass lies outside)
    tempered: dict = field(default_factory=dict)
    # float32 [B, T], asked for by --objective hass (:func:`harmonized`): probs is then HASS's teacher normalised, and
    # this its total weight, 1 + w · (the target's probability of its own top-K draft tokens); None otherwise
    scale: torch.Tensor | None = None


def harmonized(signal: TargetSignal, top_k: int, weight: float) -> TargetSignal:
    """HASS's objective (Zhang et al., ICLR 2025, "harmonized objective distillation") as a soft cross-entropy:
    −Σ_v p_v log q_v − w · Σ_{v ∈ top-K(p)} p_v log q_v = −S · Σ_v r̂_v log q_v with the teacher r = p · (1 + w ·
    [v ∈ top-K(p)]), S = Σ r and r̂ = r / S; so the kl's chunked loss computes it from r̂ with each position's weight
    times S (:func:`step_loss`). The argmax is p's (the boost keeps the order). ``signal``'s probs become r̂ in place
    (no second [B, T, Vd] float32 tensor)."""
    top = signal.probs.topk(min(top_k, signal.probs.shape[-1]), dim=-1)
    boosted = signal.probs.scatter_add_(-1, top.indices, weight * top.values)
    scale = boosted.sum(-1)
    return replace(signal, probs=boosted.div_(scale[..., None]), scale=scale)


def target_signal(final: torch.Tensor, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor,
                  chunk_tokens: int = 1024, temperatures: tuple[float, ...] = (), mass: bool = False) -> TargetSignal:
    """Teacher distributions from ``final`` [B, T, Ht] and the target lm_head weight [V, Ht]; with ``temperatures``
    (evaluation), the target's sampling distribution at each, read at the draft tokens; with ``mass``, the probability
    the target gives the draft vocabulary (:attr:`TargetSignal.mass`)."""
    batch, tokens, width = final.shape
    flat = final.reshape(-1, width).to(lm_head_weight.dtype)
    is_draft = torch.zeros(lm_head_weight.shape[0], dtype=torch.bool, device=final.device)
    is_draft[draft_ids] = True
    probs, argmax, in_draft, masses, tempered = [], [], [], [], {t: [] for t in temperatures}
    with torch.no_grad():
        for start in range(0, flat.shape[0], chunk_tokens):
            # Full-vocabulary logits in the model's dtype, one chunk of tokens at a time: their argmax says
            # whether the target's top token is a draft token, their draft columns are the teacher.
            logits = flat[start:start + chunk_tokens] @ lm_head_weight.T
            draft_logits = logits[:, draft_ids].float()
            probs.append(torch.softmax(draft_logits, dim=-1))
            if mass:
                masses.append(torch.exp(draft_logits.logsumexp(-1) - logits.float().logsumexp(-1)))
            argmax.append(draft_logits.argmax(-1))
            in_draft.append(is_draft[logits.argmax(-1)])
            for t, parts in tempered.items():
                parts.append(sampling_probs(logits, t)[:, draft_ids])
    return TargetSignal(
        probs=torch.cat(probs).view(batch, tokens, -1),
        argmax=torch.cat(argmax).view(batch, tokens),
        in_draft=torch.cat(in_draft).view(batch, tokens),
        mass=torch.cat(masses).view(batch, tokens) if mass else None,
        tempered={t: torch.cat(parts).view(batch, tokens, -1) for t, parts in tempered.items()},
    )


@dataclass
class StepResult:
    """Loss (weighted mean) and accuracy counts of one TTT step, all still on the device."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    hits: torch.Tensor  # [B, T] bool: counted here and the draft's top token is the target's


def _row_terms(z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of one chunk: (logsumexp(z), p · z, argmax z), in float32 from logits ``z`` of any float
    dtype and the teacher ``p``. Eagerly, ``einsum`` keeps p · z from being written out."""
    wide = z.float()
    return torch.logsumexp(wide, dim=-1), torch.einsum("btv,btv->bt", p, wide), z.argmax(-1)


def _row_terms_fusable(z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_row_terms` written for the compiler: the product is a reduction it fuses into one pass."""
    wide = z.float()
    return torch.logsumexp(wide, dim=-1), (p * wide).sum(-1), z.argmax(-1)


def _gradient_fusable(z: torch.Tensor, p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale · (softmax(z) − p) for one chunk, float32 (the softmax read straight from ``z``'s dtype):
    one fused kernel once compiled."""
    return torch.softmax(z, dim=-1, dtype=torch.float32).sub_(p).mul_(scale[..., None])


def _gradient_into(out: torch.Tensor, z: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`_gradient_fusable` eagerly, from the forward's logsumexp, written into ``out`` (float32) in
    place: exp(z − lse) · scale − p · scale, no temporaries (the softmax form is slower eagerly)."""
    torch.sub(z.float(), lse[..., None], out=out)
    out.exp_().mul_(scale[..., None]).addcmul_(p, scale[..., None], value=-1)


def _acceptance_fusable(z: torch.Tensor, p: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """α per row of one chunk, float32: Σ_v min(mass · p_v, softmax(z)_v) (one reduction once compiled)."""
    return torch.minimum(p * mass[..., None], torch.softmax(z, dim=-1, dtype=torch.float32)).sum(-1)


def _acceptance_gradient_fusable(z: torch.Tensor, p: torch.Tensor, mass: torch.Tensor,
                                 grad_alpha: torch.Tensor) -> torch.Tensor:
    """∂α/∂z · grad_alpha for one chunk, float32: q_j · ([q_j < p_j] − Σ_{v: q_v < p_v} q_v), q = softmax(z), p the
    target's own probabilities (mass · teacher)."""
    q = torch.softmax(z, dim=-1, dtype=torch.float32)
    inside = torch.where(q < p * mass[..., None], q, 0.0)
    return (inside - q * inside.sum(-1, keepdim=True)).mul_(grad_alpha[..., None])


class _ChunkKernels:
    """The chunk functions fused by ``torch.compile``, used on CUDA: eagerly, each is several full passes
    over a chunk of logits ([rows, T, Vd] floats), the largest item of a training step on a GPU
    (``benchmarks/train_profile.py``); compiled, the row terms are one reduction and the
    gradient one more. On the CPU the eager functions are faster once compilation is counted
    for a short run, and they need no compiler. A compiler error is reported once, then eager it is."""

    def __init__(self):
        self._compiled: tuple | None = None
        self.compile_failed = False

    def run(self, which: int, *args):
        """Compiled function ``which`` (0: row terms, 1: gradient, 2: acceptance, 3: its gradient) on ``args``; None
        if it cannot be had."""
        if self.compile_failed:
            return None
        if self._compiled is None:
            self._compiled = tuple(compiled(function, dynamic=True, keep_rounding=False) for function in (
                _row_terms_fusable, _gradient_fusable, _acceptance_fusable, _acceptance_gradient_fusable))
        try:
            return self._compiled[which](*args)
        except Exception as error:  # a compiler or backend error: the eager functions compute the same
            log.warning("eyas: the loss's chunk functions could not be compiled (%s: %s); computing them eagerly",
                        type(error).__name__, error)
            self.compile_failed = True
            return None


_KERNELS = _ChunkKernels()


class _SoftCrossEntropy(torch.autograd.Function):
    """Σ_i w_i · (−Σ_v p_iv · log_softmax(z_i)_v) over the draft vocabulary, chunk by chunk.

    The logits of a step are [B, T, Vd] (a gigabyte in bf16 for 16 k tokens); the plain expression
    makes float32 copies, the log-softmax and the product as separate tensors and keeps two for
    backward. Here only the logits and each row's logsumexp are kept; backward recomputes the softmax
    per chunk into the gradient w_i · (softmax(z_i) − p_i) (eagerly, in the gradient's own memory when
    the logits are float32). Wherever w_i ≠ 0 the target p_i is a distribution (Σp = 1), which is what
    lets −Σ p · log_softmax(z) be written lse(z) − p · z.
    """

    @staticmethod
    def forward(ctx, logits, target, weight, shift, rows, compile):
        # logits [B, T, V]; position i of a row is scored against target[:, i + shift]; weight [B, T] float32
        batch, tokens, _ = logits.shape
        usable = max(0, tokens - shift)
        lse = torch.zeros(batch, tokens, dtype=torch.float32, device=logits.device)
        top = torch.zeros(batch, tokens, dtype=torch.long, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for b0 in range(0, batch, rows):
            chunk = (slice(b0, b0 + rows), slice(0, usable))
            z, p = logits[chunk], target[b0:b0 + rows, shift:]
            terms = _KERNELS.run(0, z, p) if compile else None
            lse[chunk], dot, top[chunk] = terms if terms is not None else _row_terms(z, p)
            total += ((lse[chunk] - dot) * weight[chunk]).sum()
        ctx.save_for_backward(logits, target, weight, lse)
        ctx.shift, ctx.rows, ctx.compile = shift, rows, compile
        ctx.mark_non_differentiable(top)
        return total, top

    @staticmethod
    def backward(ctx, grad_total, _grad_top):
        logits, target, weight, lse = ctx.saved_tensors
        shift, rows = ctx.shift, ctx.rows
        usable = max(0, logits.shape[1] - shift)
        grad = torch.empty_like(logits)
        grad[:, usable:] = 0
        for b0 in range(0, logits.shape[0], rows):
            chunk = (slice(b0, b0 + rows), slice(0, usable))
            z, p, scale = logits[chunk], target[b0:b0 + rows, shift:], weight[chunk] * grad_total
            fused = _KERNELS.run(1, z, p, scale) if ctx.compile else None
            if fused is not None:
                grad[chunk] = fused
                continue
            in_place = grad.dtype == torch.float32  # float32 logits: the gradient's own memory is the workspace
            out = grad[chunk] if in_place else torch.empty(z.shape, dtype=torch.float32, device=z.device)
            _gradient_into(out, z, p, lse[chunk], scale)
            if not in_place:
                grad[chunk] = out
        return grad, None, None, None, None, None


class _Acceptance(torch.autograd.Function):
    """α_i = Σ_v min(p_iv, q_iv) per row, chunk by chunk: the chance a draft drawn from the drafter's q = softmax(z_i)
    is kept against the target's p (its own probabilities of the draft vocabulary: the teacher's, times ``mass``).
    Backward recomputes q per chunk: ∂α/∂z_j = q_j · ([q_j < p_j] − Σ_{v: q_v < p_v} q_v)."""

    @staticmethod
    def forward(ctx, logits, target, mass, shift, rows, compile):
        batch, tokens, _ = logits.shape
        usable = max(0, tokens - shift)
        alpha = torch.zeros(batch, tokens, dtype=torch.float32, device=logits.device)
        for b0 in range(0, batch, rows):
            chunk = (slice(b0, b0 + rows), slice(0, usable))
            args = (logits[chunk], target[b0:b0 + rows, shift:], mass[b0:b0 + rows, shift:])
            fused = _KERNELS.run(2, *args) if compile else None
            alpha[chunk] = fused if fused is not None else _acceptance_fusable(*args)
        ctx.save_for_backward(logits, target, mass)
        ctx.shift, ctx.rows, ctx.compile = shift, rows, compile
        return alpha

    @staticmethod
    def backward(ctx, grad_alpha):
        logits, target, mass = ctx.saved_tensors
        shift, rows = ctx.shift, ctx.rows
        usable = max(0, logits.shape[1] - shift)
        grad = torch.zeros_like(logits)
        for b0 in range(0, logits.shape[0], rows):
            chunk = (slice(b0, b0 + rows), slice(0, usable))
            args = (logits[chunk], target[b0:b0 + rows, shift:], mass[b0:b0 + rows, shift:], grad_alpha[chunk])
            fused = _KERNELS.run(3, *args) if ctx.compile else None
            grad[chunk] = fused if fused is not None else _acceptance_gradient_fusable(*args)
        return grad, None, None, None, None, None


def step_loss(logits: torch.Tensor, signal: TargetSignal, loss_mask: torch.Tensor, step: int,
              chunk_tokens: int = 4096, compile: bool | None = None, objective: str = "kl",
              lk_decay: float = 1.0) -> StepResult:
    """Step ``step``: position i predicts token i+2+step from the target's distribution at i+1+step.
    ``compile``: fuse the per-chunk arithmetic with torch.compile (None: on CUDA). ``objective`` (--objective,
    :data:`eyas.families.eagle3.options.OBJECTIVES`):
    kl, the soft cross-entropy to the teacher (EAGLE-3's); the LK losses (arXiv 2602.23881) aim at the acceptance α of
    drafts drawn from the drafter (:class:`_Acceptance`) — lk-alpha −mean log α, lk-lambda w · kl + (1 − w) · (1 −
    mean α) with w = exp(−``lk_decay`` · mean α) (not differentiated), kl while α is low and α as it rises; hass, the kl
    plus HASS's top-K term, from a signal :func:`harmonized` made."""
    shift = 1 + step
    weight = (shift_left(loss_mask, shift + 1) > 0) & shift_left(signal.in_draft, shift, fill=False)
    w = weight.float()
    count = w.sum()
    if objective == "hass":
        if signal.scale is None:
            raise ValueError("objective 'hass' reads HASS's teacher: build the signal with harmonized()")
        w = w * shift_left(signal.scale, shift, fill=1.0)
    rows = max(1, chunk_tokens // max(1, logits.shape[1]))  # whole rows per chunk: no copy of the logits
    compile = logits.device.type == "cuda" if compile is None else compile
    total, top = _SoftCrossEntropy.apply(logits, signal.probs, w, shift, rows, compile)
    hits = (top == shift_left(signal.argmax, shift)) & weight
    loss = total / count.clamp(min=1.0)
    if objective.startswith("lk"):
        if signal.mass is None:
            raise ValueError(f"objective {objective!r} reads the target's mass: build the signal with mass=True")
        alpha = _Acceptance.apply(logits, signal.probs, signal.mass, shift, rows, compile)
        if objective == "lk-alpha":
            loss = -(torch.log(alpha.clamp(min=1e-30)) * w).sum() / count.clamp(min=1.0)
        else:
            mean = (alpha * w).sum() / count.clamp(min=1.0)
            kl_weight = torch.exp(-lk_decay * mean.detach())
            loss = kl_weight * loss + (1 - kl_weight) * (1 - mean)
    return StepResult(loss=loss, correct=hits.sum(), count=count, hits=hits)
