"""The DSpark drafter in eyas' engine: lossless on every architecture, greedy and sampled, recorded rounds included.

Greedy output must equal the target's own (the uncached reference of test_engine_greedy). Beyond the output, every
block the engine runs is checked against the drafter from scratch — the target's states at its taps for the whole
sequence so far, recaptured without any cache, and :func:`eyas.families.dspark.model.propose` — so the context cache,
its commits and the masking of what the target did not accept are pinned, and so is every step of the Markov chain. An
oracle (the first ``right`` slots made certain of the reference's next tokens) makes rounds accept, so multi-state
commits are exercised and τ is known in advance. Sampled: a drawn chain is judged against the distribution each draft
was drawn from, which the Markov head makes depend on the draw before it; χ² counts the target's distribution.
"""

import pytest
import torch

from eyas.engine.acceptance import Sampling
from eyas.engine.decode import generate
from eyas.engine.target_runner import TargetRunner
from eyas.families.dspark.config import dspark_config_from_target
from eyas.families.dspark.model import DSparkDrafter, propose
from eyas.families.dspark.runner import SparkRunner, check_spark_modes
from eyas.speculation import Chain
from eyas.target.capture import capture_hidden_states
from eyas.target.layer_ids import default_layer_ids
from eyas.target.layout import discover_layout
from test_engine_greedy import prompt_of, reference_greedy
from test_engine_tree_sampling import assert_second_token_follows, first_two_distributions
from zoo import ARCHITECTURES

NEW_TOKENS = 20
BLOCK = 3
CHAIN = Chain(BLOCK)


def spark_runners(model, capacity=96, seed=0):
    layout = discover_layout(model)
    config = dspark_config_from_target(model.config, default_layer_ids(layout.num_layers), BLOCK, draft_layers=2,
                                       markov_rank=8)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config).eval()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)  # a trained head is not zero
    return (TargetRunner(model, layout, config.layer_ids, capacity),
            SparkRunner(drafter, layout.embed.weight, layout.lm_head, capacity + 16))


class CheckedBlocks:
    """Wraps the runner's steps: each block's backbone logits are compared with the drafter's from scratch over the
    sequence so far (``sequence``: prompt + every token emitted, the reference's), and each step with the chain's
    rule — slots in order from 0, slot 0 after the root, slot j after the token chosen at slot j − 1, its logits the
    from-scratch backbone's plus that token's Markov bias. With ``right`` set, the first ``right`` slots are made
    certain of the reference's next tokens and the rest of a token the reference never emits there."""

    def __init__(self, model, runner: SparkRunner, sequence: list[int], right: int | None = None):
        self.model, self.runner, self.sequence, self.right = model, runner, sequence, right
        self.real_backbone, self.real_step = runner.backbone_logits, runner.step_logits
        self.blocks, self.anchor, self.scratch = 0, None, None
        runner.backbone_logits, runner.step_logits = self.backbone, self.step

    def backbone(self, root, anchor):
        base = self.real_backbone(root, anchor)
        at = self.anchor = int(anchor)
        self.slot, self.previous = 0, int(root)
        if at >= len(self.sequence):  # a burst's rounds past the output's end (their tokens are dropped)
            self.scratch = None
            return base
        assert int(root) == self.sequence[at], "the block's root is not the token at its anchor"
        layout = discover_layout(self.model)
        states = capture_hidden_states(self.model, layout, torch.tensor([self.sequence[:at]]),
                                       layer_ids=self.runner.config.layer_ids, offload=False).aux
        drafter = self.runner.drafter
        cache = drafter.context_kv(drafter.context(states), torch.arange(at)[None])
        _, rows = propose(drafter, cache, int(root), at, layout.embed, layout.lm_head.weight, previous=[0] * BLOCK)
        self.scratch = rows - drafter.markov_head(torch.tensor(0))  # the backbone's logits alone
        torch.testing.assert_close(base, self.scratch, rtol=1e-4, atol=1e-4)
        self.blocks += 1
        return base

    def step(self, slot, previous):
        assert slot == self.slot and int(previous) == self.previous, "the chain's steps are out of order"
        logits = self.real_step(slot, previous)
        if self.scratch is not None:
            expected = self.scratch[slot] + self.runner.drafter.markov_head(previous.view(()))
            torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
        at = self.anchor
        if self.right is not None and at < len(self.sequence):
            truth = (self.sequence[at + 1 : at + 1 + BLOCK] + [0] * BLOCK)[slot]
            token = truth if slot < self.right else (truth + 1) % self.runner.config.vocab_size
            logits = torch.nn.functional.one_hot(torch.tensor([token]), logits.shape[-1]).float() * 100.0
        self.slot, self.previous = slot + 1, int(logits.argmax())
        return logits


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_dspark_speculation_is_lossless_and_drafts_what_the_drafter_drafts_from_scratch(arch):
    model = ARCHITECTURES[arch][0]()
    target, runner = spark_runners(model)
    prompt = prompt_of(3)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    checked = CheckedBlocks(model, runner, prompt[0].tolist() + expected)
    result = generate(target, prompt, NEW_TOKENS, runner, CHAIN)
    assert result.tokens == expected, f"{arch}: DSpark speculation differs from the uncached reference"
    assert checked.blocks >= result.rounds >= NEW_TOKENS // (BLOCK + 1)


@pytest.mark.parametrize("right", [0, 1, 3])
def test_accepted_drafts_commit_their_states_and_tau_counts_them(right):
    """Rounds whose first ``right`` drafts are the target's: each emits right + 1 tokens (the bonus after them), and
    the next block's context holds every accepted state — checked against the from-scratch drafter each round."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = spark_runners(model)
    prompt = prompt_of(5)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    checked = CheckedBlocks(model, runner, prompt[0].tolist() + expected, right=right)
    result = generate(target, prompt, NEW_TOKENS, runner, CHAIN)
    assert result.tokens == expected
    assert all(a == right for a in result.accepted[:-1]), result.accepted  # the last round may be cut by the limit
    assert checked.blocks >= result.rounds == -(-(NEW_TOKENS - 1) // (right + 1))


@pytest.mark.parametrize("verification", ["standard", "block"])
def test_drawn_drafts_follow_the_target_when_each_draw_moves_the_next_slot(verification, monkeypatch):
    """Drafts drawn slot by slot (``draft_sampling="probabilistic"``): slot 0 puts 0.6 / 0.4 on the target's two
    likeliest tokens, and the next slot's distribution depends on which was drawn (as the Markov head makes it), so a
    judge that read any other distribution than the one each draft came from would skew the token decided after the
    block: χ² counts it against the target's."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = spark_runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    likely, runner_up = second_probs.topk(2).indices.tolist()

    def pinned(self, slot, previous):
        wanted = torch.full((256,), 1e-9)
        if slot == 0:
            wanted[[likely, runner_up]] = torch.tensor([0.6, 0.4])
        else:  # after the likeliest token: mostly the runner-up; after anything else: mostly the likeliest
            wanted[[likely, runner_up]] = torch.where(previous.view(()) == likely, torch.tensor([0.1, 0.9]),
                                                      torch.tensor([0.9, 0.1]))
        return (0.05 * wanted.log())[None]

    monkeypatch.setattr(SparkRunner, "step_logits", pinned)
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, runner, CHAIN, Sampling(
            temperature=0.05, seed=seed, draft_sampling="probabilistic", verification=verification)),
        first, second_probs, seeds=600, least=150)


def test_greedy_drafts_judged_by_sampling_follow_the_target():
    """Deterministic drafts (``draft_sampling="greedy"``) under a sampled judge: the likeliest token first, then
    unlikely ones."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = spark_runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    likely = int(second_probs.argmax())
    real = runner.step_logits
    runner.step_logits = lambda slot, previous: (real(slot, previous), torch.nn.functional.one_hot(
        torch.tensor([likely if slot == 0 else 0]), 256).float() * 100.0)[1]
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, runner, CHAIN, Sampling(temperature=0.05, seed=seed,
                                                                         draft_sampling="greedy")),
        first, second_probs, seeds=600, least=150)


def test_modes_a_dspark_drafter_cannot_decode_are_refused_in_one_line():
    from eyas.engine.modes import parse_mode
    from eyas.errors import EyasError

    check_spark_modes([parse_mode("chain:3"), parse_mode("chain:1")], BLOCK, "D")
    for mode in ("chain:4", "tree:10,3,4"):
        with pytest.raises(EyasError, match="chain:K with K ≤ 3"):
            check_spark_modes([parse_mode(mode)], BLOCK, "D")


def test_dspark_rounds_replayed_from_recordings_stay_lossless_across_prompts():
    """With (fake) CUDA graphs a round is recorded once and replayed for every later prompt: everything it reads — the
    root, the anchor, the context cache, the Markov chain's tokens — must be buffers that outlive one generation."""
    from test_engine_greedy import ReplayFirst

    model = ARCHITECTURES["qwen3"][0]()
    target, runner = spark_runners(model)
    target.graphs = target.prefill_graphs = ReplayFirst()
    target.prefill(prompt_of(0, length=3))  # the first forward allocates the cache: never recorded
    eager_target, eager_runner = spark_runners(model)
    for seed, length in ((21, 8), (22, 9), (23, 13)):
        prompt = prompt_of(seed, length)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        assert generate(target, prompt, NEW_TOKENS, runner, CHAIN).tokens == expected, seed
        sampled = Sampling(temperature=1.0, seed=seed)
        assert generate(target, prompt, 6, runner, CHAIN, sampled).tokens == \
            generate(eager_target, prompt, 6, eager_runner, CHAIN, sampled).tokens
    kinds = sorted(str(key[:2]) for key in target.graphs.recorded if isinstance(key, tuple))
    drawn = Sampling(temperature=1.0).resolved("chain")  # a chain's default sampled rule draws its drafts
    assert drawn.draft_sampling == "probabilistic"
    assert kinds == sorted(str((step, "chain")) for step in ("burst", ("burst", drawn.recorded)))
