"""EAGLE-3's own options of ``eyas train`` (the registry adds them to its flags, each help led by "eagle3: ")."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.data.benchmarks import DATASETS
from eyas.options import Check, Options, above, at_least, each, one_of, option, within
from eyas.speculation import chain_depths

OBJECTIVES = ("kl", "lk-lambda", "lk-alpha", "hass")  # --objective: each TTT step's loss (eyas.families.eagle3.loss.step_loss)


@dataclass
class Eagle3Options(Options):
    """How an EAGLE-3 drafter is built, trained (training-time test) and evaluated."""

    ttt_steps: int = option(7, "training-time-test steps K", check=at_least(1))
    step_decay: float = option(0.8, "weight of step k's loss is decay^k", check=within(0, 1, low_open=True))
    objective: str = option("kl", "each TTT step's loss: kl = soft cross-entropy to the target's distribution over the "
                            "draft vocabulary (EAGLE-3's); the LK losses (arXiv 2602.23881) aim at α, the chance a draft "
                            "drawn from the drafter is kept: lk-alpha = −mean log α, lk-lambda = w · kl + (1 − w) · "
                            "(1 − mean α), w = exp(−lk-decay · mean α); hass = kl + hass-weight · the cross-entropy "
                            "over the target's top hass-top-k draft tokens only (HASS, ICLR 2025)",
                            check=one_of(*OBJECTIVES))
    lk_decay: float = option(1.0, "--objective lk-lambda: how fast the loss moves from kl to α as α rises",
                             check=above(0))
    hass_top_k: int = option(10, "--objective hass: the target's K most likely draft tokens the extra term reads",
                             check=at_least(1))
    hass_weight: float = option(1.0, "--objective hass: the extra term's weight", check=above(0))
    attention: str = option("auto", "how TTT steps after the first attend (the same result up to rounding; only speed "
                            "and memory differ): concat = one fused attention over real and own keys under a mask, "
                            "split = a causal flash kernel over real keys merged with the own keys by log-sum-exp, "
                            "scores = written out; auto = split on a GPU, scores elsewhere",
                            check=one_of("auto", "concat", "split", "scores"))
    eval_temperatures: tuple[float, ...] = option((1.0,), "each holdout evaluation also simulates τ at these sampling "
                                                  "temperatures, comma-separated, for chains whose drafts are drawn "
                                                  "from the drafter (eyas generate/bench at --temperature T)",
                                                  check=each(above(0)))
    hidden_size: int | None = option(None, "drafter width (default: the target's)", check=at_least(1))
    fc_norm: bool = option(False, "EAGLE-3.1: an RMSNorm on each target state before fc (config fc_norm; vLLM 0.32 and "
                           "SGLang 0.5.23 run it)", flag="--fc-norm/--no-fc-norm")
    norm_output: bool = option(False, "EAGLE-3.1: the layer's post-norm output is the next step's hidden instead of "
                               "the pre-norm one (config norm_output)", flag="--norm-output/--no-norm-output")
    predict: tuple[str, ...] | None = option(None, "online: each evaluation also predicts the τ eyas bench will "
                                             "measure on these datasets (comma-separated: mt-bench, humaneval, "
                                             "sharegpt-holdout), from the target's own answers to bench's prompts, "
                                             "decoded once at the start as bench decodes them",
                                             check=each(one_of(*DATASETS)))
    predict_prompts: int = option(10, "--predict: the first N prompts of each dataset (bench's --prompts N)",
                                  check=at_least(1))
    predict_tokens: tuple[int, ...] = option((256, 512), "--predict: answer lengths, comma-separated (bench's "
                                             "--max-new-tokens)", check=each(at_least(1)))
    predict_modes: str = option("chain:3,chain:5", "--predict: the chains, comma-separated chain:K (bench's --mode; "
                                "vLLM's num_speculative_tokens K)", check=Check(chain_depths, "chain:K, comma-separated",
                                                                                shown=False))
    predict_temperatures: tuple[float, ...] = option((1.0,), "--predict: sampling temperatures besides T = 0, "
                                                     "comma-separated: chains whose drafts are drawn from the drafter "
                                                     "(bench's rule at T > 0)", check=each(above(0)))
    predict_samples: int = option(4, "--predict: answers drawn per prompt at each sampling temperature (their "
                                  "expected rounds pooled, as bench --samples pools its draws)", check=at_least(1))
