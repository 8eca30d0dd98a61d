"""The DFlash block drafter in eyas' engine: lossless on every architecture, greedy and sampled.

Greedy output must equal the target's own (the uncached reference of test_engine_greedy). Beyond the output, every
block the engine drafts is checked against the drafter run from scratch — the target's states at the drafter's taps
for the whole sequence so far, recaptured without any cache, and :func:`eyas.families.dflash.model.propose` — so the
context cache, its commits and the masking of what the target did not accept are pinned too. A random drafter is
rarely right; an oracle (the real block is drafted and checked, then the reference's next tokens replace its first
``right`` drafts) makes rounds accept, so multi-state commits are exercised and τ is known in advance.
"""

import pytest
import torch

from eyas.engine.acceptance import Sampling
from eyas.engine.decode import generate
from eyas.speculation import Chain
from eyas.engine.target_runner import TargetRunner
from eyas.families.dflash.config import dflash_config_from_target
from eyas.families.dflash.model import DFlashDrafter, propose
from eyas.families.dflash.runner import BlockDraftRunner
from eyas.target.capture import capture_hidden_states
from eyas.target.layer_ids import default_layer_ids
from eyas.target.layout import discover_layout
from test_engine_greedy import prompt_of, reference_greedy
from test_engine_tree_sampling import assert_second_token_follows, first_two_distributions
from zoo import ARCHITECTURES

NEW_TOKENS = 20
BLOCK = 4
CHAIN = Chain(BLOCK - 1)


def block_runners(model, capacity=96, seed=0):
    layout = discover_layout(model)
    config = dflash_config_from_target(model.config, default_layer_ids(layout.num_layers), BLOCK, draft_layers=2)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).eval()
    return (TargetRunner(model, layout, config.layer_ids, capacity),
            BlockDraftRunner(drafter, layout.embed.weight, layout.lm_head, capacity + BLOCK))


class CheckedBlocks:
    """Wraps the runner's propose: each block is compared with the drafter run from scratch over the sequence so far
    (``sequence``: prompt + every token emitted, the reference's); with ``right`` set, its first ``right`` drafts are
    then replaced by the reference's next tokens and the rest by a token the reference never emits there."""

    def __init__(self, model, runner: BlockDraftRunner, sequence: list[int], right: int | None = None):
        self.model, self.runner, self.sequence, self.right = model, runner, sequence, right
        self.real = runner.propose
        self.blocks = 0
        runner.propose = self

    def __call__(self, root, anchor, steps):
        drafts = self.real(root, anchor, steps)
        at = int(anchor)
        if at >= len(self.sequence):  # a burst's rounds past the output's end (their tokens are dropped)
            return drafts
        assert int(root) == self.sequence[at], "the block's root is not the token at its anchor"
        layout = discover_layout(self.model)
        states = capture_hidden_states(self.model, layout, torch.tensor([self.sequence[:at]]),
                                       layer_ids=self.runner.config.layer_ids, offload=False).aux
        drafter = self.runner.drafter
        cache = drafter.context_kv(drafter.context(states), torch.arange(at)[None])
        expected = propose(drafter, cache, int(root), at, layout.embed, layout.lm_head.weight)[:steps]
        assert drafts.tolist() == expected.tolist(), f"block at {at}: the engine's cache drafts differently"
        self.blocks += 1
        if self.right is None:
            return drafts
        truth = (self.sequence[at + 1 : at + 1 + steps] + [0] * steps)[:steps]  # past the reference's end: anything
        return torch.tensor([t if i < self.right else (t + 1) % self.runner.config.vocab_size for i, t in enumerate(truth)])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_block_speculation_is_lossless_and_drafts_what_the_drafter_drafts_from_scratch(arch):
    model = ARCHITECTURES[arch][0]()
    target, runner = block_runners(model)
    prompt = prompt_of(3)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    checked = CheckedBlocks(model, runner, prompt[0].tolist() + expected)
    result = generate(target, prompt, NEW_TOKENS, runner, CHAIN)
    assert result.tokens == expected, f"{arch}: block speculation differs from the uncached reference"
    assert checked.blocks >= result.rounds >= NEW_TOKENS // BLOCK


@pytest.mark.parametrize("right", [0, 1, 3])
def test_accepted_drafts_commit_their_states_and_tau_counts_them(right):
    """Rounds whose first ``right`` drafts are the target's: each emits right + 1 tokens (the bonus after them), the
    next block's context holds every accepted state — checked against the from-scratch drafter each round."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = block_runners(model)
    prompt = prompt_of(5)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    checked = CheckedBlocks(model, runner, prompt[0].tolist() + expected, right=right)
    result = generate(target, prompt, NEW_TOKENS, runner, CHAIN)
    assert result.tokens == expected
    assert all(a == right for a in result.accepted[:-1]), result.accepted  # the last round may be cut by the limit
    assert checked.blocks >= result.rounds == -(-(NEW_TOKENS - 1) // (right + 1))


def test_sampled_block_speculation_follows_the_target():
    """Sampling: the token decided after a block's draft follows the target's distribution (χ²), with drafts that are
    the target's likeliest token (often accepted) and then unlikely ones."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = block_runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    likely = int(second_probs.argmax())
    real = runner.propose
    runner.propose = lambda root, anchor, steps: (real(root, anchor, steps), torch.tensor([likely, 0, 0])[:steps])[1]
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, runner, CHAIN, Sampling(temperature=0.05, seed=seed,
                                                                         draft_sampling="greedy")),
        first, second_probs, seeds=600, least=150)


def test_modes_a_block_drafter_cannot_decode_are_refused_in_one_line(tmp_path):
    from eyas.engine.modes import parse_mode
    from eyas.errors import EyasError
    from eyas.families.dflash.runner import check_block_modes

    check_block_modes([parse_mode("chain:3")], BLOCK, "D")
    for mode in ("chain:4", "tree:10,3,4"):
        with pytest.raises(EyasError, match="chain:K with K ≤ 3"):
            check_block_modes([parse_mode(mode)], BLOCK, "D")


def test_block_rounds_replayed_from_recordings_stay_lossless_across_prompts():
    """With (fake) CUDA graphs a block round is recorded once and replayed for every later prompt: everything it
    reads — the root, the anchor, the context cache — must be buffers that outlive one generation."""
    from test_engine_greedy import ReplayFirst

    model = ARCHITECTURES["qwen3"][0]()
    target, runner = block_runners(model)
    target.graphs = target.prefill_graphs = ReplayFirst()
    target.prefill(prompt_of(0, length=3))  # the first forward allocates the cache: never recorded
    for seed, length in ((21, 8), (22, 9), (23, 13)):
        prompt = prompt_of(seed, length)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        assert generate(target, prompt, NEW_TOKENS, runner, CHAIN).tokens == expected, seed
        generate(target, prompt, 6, runner, CHAIN, Sampling(temperature=1.0, seed=seed))
    kinds = sorted(str(key[:2]) for key in target.graphs.recorded if isinstance(key, tuple))
    drawn = Sampling(temperature=1.0).resolved("chain")  # a chain's default sampled rule draws its drafts
    assert drawn.draft_sampling == "probabilistic"
    assert kinds == sorted(str((step, "chain")) for step in ("burst", ("burst", drawn.recorded)))


@pytest.mark.parametrize("verification", ["standard", "block"])
def test_drawn_block_drafts_follow_the_target(verification, monkeypatch):
    """A block's slots drawn from their own distributions (``draft_sampling="probabilistic"``): the token decided
    after the first block follows the target's distribution (χ²). Every slot's distribution is pinned to 0.6 / 0.4
    on the target's two likeliest tokens, so the first draft is accepted and rejected often."""
    model = ARCHITECTURES["llama"][0]()
    target, runner = block_runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    wanted = torch.full((256,), 1e-9)
    wanted[second_probs.topk(2).indices] = torch.tensor([0.6, 0.4])
    monkeypatch.setattr(BlockDraftRunner, "slot_logits", lambda self, root, anchor, steps: (0.05 * wanted.log()).expand(steps, -1))
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, runner, CHAIN, Sampling(
            temperature=0.05, seed=seed, draft_sampling="probabilistic", verification=verification)),
        first, second_probs, seeds=600, least=150)
