"""The engine's greedy decoding is lossless: chain and tree output == plain output == the target's own greedy.

The reference is the most independent one there is: the full prefix re-run through the HF model
without any cache, argmax, append (and transformers' ``generate`` where the model has one). A
random drafter checks the no-acceptance path on every architecture; an oracle drafter that is right
for exactly the first j drafts checks acceptance, the bonus token, cache commits and τ accounting,
whose values are then known in advance.
"""

import pytest
import torch

import eyas.engine.decode as decode
from eyas.engine.decode import Speculation, generate
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.target_runner import TargetRunner
from eyas.target.layout import discover_layout
from test_drafter_consistency import random_drafter, tiny_config
from zoo import ARCHITECTURES

NEW_TOKENS = 24


def reference_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


def runners(model, capacity=128, seed=0, static_shapes=False):
    layout = discover_layout(model)
    drafter = random_drafter(tiny_config(vocab_size=layout.vocab_size, draft_vocab_size=100), seed=seed)
    drafter.load_target_embedding(layout.embed.weight)
    return (TargetRunner(model, layout, None, capacity, static_shapes),
            DraftRunner(drafter, capacity, static_shapes=static_shapes))


def prompt_of(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(1, 240, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_speculation_is_lossless_on_every_architecture(arch):
    model = ARCHITECTURES[arch][0]()
    target, drafter = runners(model)
    for seed in range(2):
        prompt = prompt_of(seed)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        plain = generate(target, prompt, NEW_TOKENS)
        chain = generate(target, prompt, NEW_TOKENS, drafter, Speculation("chain", 4))
        tree = generate(target, prompt, NEW_TOKENS, drafter, Speculation("tree", top_k=4, depth=3, total=10))
        assert plain.tokens == expected, f"{arch}: plain decoding differs from the uncached reference"
        assert chain.tokens == expected, f"{arch}: chain speculation differs from the uncached reference"
        assert tree.tokens == expected, f"{arch}: tree speculation differs from the uncached reference"
        if hasattr(model, "generate") and arch != "qwen2_5_vl":  # its generate needs multimodal rope inputs
            hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False)
            assert hf[0, prompt.shape[1] :].tolist() == expected


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_static_shapes_decode_the_same(arch):
    """The CUDA-graph-ready mode (attention over the whole capacity, aux taps into one buffer) changes nothing."""
    model = ARCHITECTURES[arch][0]()
    target, drafter = runners(model, static_shapes=True)
    prompt = prompt_of(5)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    for speculation in (None, Speculation("chain", 4), Speculation("tree", top_k=4, depth=3, total=10)):
        assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected
    assert target.cache.visible == target.capacity


def test_prompts_of_new_lengths_add_no_static_shape():
    """A prompt's states are committed eagerly, so no step shape is kept per prompt length. Greedy rounds
    run as bursts: one recorded round per mode, no drafter step shape at all. Sampled rounds are driven
    by the host, and every shape one can take is run before the first (on a GPU no graph is recorded
    while decoding)."""
    from eyas.engine.verify import Sampling

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, static_shapes=True)
    sampled = Sampling(temperature=1.0, seed=3)
    for speculation in (Speculation("chain", 4), Speculation("tree", top_k=4, depth=3, total=10)):
        prompt = prompt_of(1, length=8)
        assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == reference_greedy(model, prompt, NEW_TOKENS)
        assert drafter.shapes == frozenset(), speculation.label()
    for speculation in (Speculation("chain", 4), Speculation("tree", top_k=4, depth=3, total=10)):
        generate(target, prompt_of(1, length=8), NEW_TOKENS, drafter, speculation, sampling=sampled)
        after_first = drafter.shapes
        if speculation.mode == "chain":  # ("chain", states, steps): commit and drafts in one step
            committed = {key[1] for key in after_first if key[0] == "chain"}
        else:  # (states, window, top_k, from_target)
            committed = {key[0] for key in after_first if key[0] != "chain" and key[3]}
        assert committed == set(range(1, speculation.max_depth + 2)), speculation.label()
        for seed, length in ((2, 11), (3, 17), (4, 23)):
            prompt = prompt_of(seed, length)
            generate(target, prompt, NEW_TOKENS, drafter, speculation, sampling=sampled)
            assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == reference_greedy(model, prompt, NEW_TOKENS)
        assert drafter.shapes == after_first, speculation.label()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_a_padded_static_prefill_equals_the_eager_one(arch):
    """After the first forward (which allocates the cache), a static runner pads a prompt to its bucket and
    runs it as one fixed-shape step: the last token's logits and every prompt token's aux states are the
    eager prefill's, and a prompt longer than the largest bucket still runs (eagerly)."""
    model = ARCHITECTURES[arch][0]()
    eager, _ = runners(model)
    static, _ = runners(model, static_shapes=True)
    static.prefill(prompt_of(0, length=5))  # the first forward: allocates, not padded
    assert not static._prefill_inputs
    for seed, length in ((1, 9), (2, 16), (3, 23)):
        prompt = prompt_of(seed, length)
        expected_logits, expected_aux = eager.prefill(prompt)
        logits, aux = static.prefill(prompt)
        assert static.length == length
        assert torch.allclose(logits, expected_logits, atol=1e-5), (arch, length)
        assert torch.allclose(aux, expected_aux, atol=1e-5), (arch, length)
    assert set(static._prefill_inputs) == {16, 32}  # 9 and 16 share a bucket
    static.PREFILL_BUCKETS = (16,)
    long_prompt = prompt_of(4, 20)
    assert torch.allclose(static.prefill(long_prompt)[0], eager.prefill(long_prompt)[0], atol=1e-5)
    expected = reference_greedy(model, long_prompt, 8)
    assert generate(static, long_prompt, 8).tokens == expected


class OracleDrafter(DraftRunner):
    """Drafts the true greedy continuation, except that draft ``wrong_at`` of every round is wrong."""

    def __init__(self, base: DraftRunner, continuation: list[int], prompt_length: int, wrong_at: int):
        super().__init__(base.drafter, base.capacity)
        self.continuation, self.prompt_length, self.wrong_at = continuation, prompt_length, wrong_at

    def draft_chain(self, aux, next_tokens, positions, steps):
        super().draft_chain(aux, next_tokens, positions, steps)  # exercise the real cache bookkeeping too
        done = int(positions[0, -1]) + 2 - self.prompt_length  # tokens emitted so far
        drafts = [self.continuation[min(done + i, len(self.continuation) - 1)] for i in range(steps)]
        if self.wrong_at < steps:
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 256
        return torch.tensor(drafts)


@pytest.mark.parametrize("wrong_at", [0, 2, 5])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_accepted_drafts_commit_correctly_and_tau_counts_them(arch, wrong_at):
    model = ARCHITECTURES[arch][0]()
    target, drafter = runners(model)
    prompt = prompt_of(7)
    expected = reference_greedy(model, prompt, NEW_TOKENS + 8)
    oracle = OracleDrafter(drafter, expected, prompt.shape[1], wrong_at)
    chain = generate(target, prompt, NEW_TOKENS, oracle, Speculation("chain", 5))
    assert chain.tokens == expected[:NEW_TOKENS]
    accepted = min(wrong_at, 5)  # every round accepts exactly the drafts before the wrong one
    assert chain.accepted == [accepted] * chain.rounds
    assert chain.rounds == -(-(NEW_TOKENS - 1) // (accepted + 1))  # the first token comes from the prefill
    assert chain.tau == 1 + accepted
    assert chain.accepted_at() == [1.0] * accepted + [0.0] * (5 - accepted)


@pytest.mark.parametrize("static_shapes", [False, True])  # static: plain greedy decodes in bursts
def test_generation_stops_at_a_stop_token_and_keeps_it(static_shapes):
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, static_shapes=static_shapes)
    prompt = prompt_of(3)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    stop = expected[5]
    first = expected.index(stop)
    oracle = OracleDrafter(drafter, expected + [0] * 8, prompt.shape[1], 9)
    for generation in (generate(target, prompt, NEW_TOKENS, stop_ids=[stop]),
                       generate(target, prompt, NEW_TOKENS, oracle, Speculation("chain", 4), stop_ids=[stop])):
        assert generation.tokens == expected[: first + 1]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_sequence_longer_than_the_cache_is_refused_with_advice(static_shapes):
    model = ARCHITECTURES["llama"][0]()
    target, _ = runners(model, capacity=16, static_shapes=static_shapes)
    with pytest.raises(Exception, match="raise max_length"):
        generate(target, prompt_of(0), NEW_TOKENS)


def test_greedy_bursts_commit_every_token_and_chain_across_bursts(monkeypatch):
    """Plain greedy decoding with static shapes runs in bursts of BURST steps, each fed on the device."""
    model = ARCHITECTURES["llama"][0]()
    target, _ = runners(model, capacity=128, static_shapes=True)
    monkeypatch.setattr(target, "BURST", 5)  # 24 new tokens: the first from the prefill, then bursts of 5, 5, 5, 5, 3
    calls = []
    burst = target.greedy_burst
    monkeypatch.setattr(target, "greedy_burst", lambda token, steps: calls.append(steps) or burst(token, steps))
    prompt = prompt_of(8)
    tokens = generate(target, prompt, NEW_TOKENS).tokens
    assert tokens == reference_greedy(model, prompt, NEW_TOKENS)
    assert calls == [5, 5, 5, 5, 3]
    assert target.length == prompt.shape[1] + NEW_TOKENS - 1  # every run token committed (the last is emitted only)


def test_static_drafting_drafts_what_eager_drafting_drafts():
    """The CUDA-graph-ready drafter (one recorded function per chain, per-shape tree steps, device-built
    masks) proposes exactly the eager drafter's tokens, round after round as the committed prefix grows."""
    from eyas.engine.tree import draft_tree

    model = ARCHITECTURES["llama"][0]()
    _, eager = runners(model)
    _, static = runners(model, static_shapes=True)
    assert static.static_shapes and not eager.static_shapes
    gen = torch.Generator().manual_seed(9)
    width = eager.drafter.config.aux_width
    start = 0
    for n in (5, 1, 3, 2):  # a prompt, then rounds accepting different numbers of drafts
        aux = torch.randn(1, n, width, generator=gen)
        tokens = torch.randint(0, 256, (1, n), generator=gen)
        positions = torch.arange(start, start + n).unsqueeze(0)
        assert torch.equal(static.draft_chain(aux, tokens, positions, 4), eager.draft_chain(aux, tokens, positions, 4))
        assert static.length == eager.length == start + n and static.speculative == eager.speculative == 0
        start += n
    for runner in (eager, static):
        runner.reset()
    aux = torch.randn(1, 6, width, generator=gen)
    tokens = torch.randint(0, 256, (1, 6), generator=gen)
    positions = torch.arange(6).unsqueeze(0)
    trees = [draft_tree(runner, aux, tokens, positions, root=3, top_k=4, depth=3, total=10) for runner in (eager, static)]
    for field in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(trees[0], field), getattr(trees[1], field))


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_window_on_every_layer_is_honoured(static_shapes):
    """Mistral-style: a sliding window and no layer types means every layer slides (as HF's forward does);
    with a window shorter than the sequence, decoding must still equal the uncached reference."""
    from transformers import MistralConfig, MistralForCausalLM

    from zoo import _TEXT, _seeded

    model = _seeded(lambda: MistralForCausalLM(MistralConfig(**_TEXT, sliding_window=6)))
    target, drafter = runners(model, static_shapes=static_shapes)
    assert target.sliding_everywhere
    prompt = prompt_of(1)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    for speculation in (None, Speculation("chain", 3), Speculation("tree", top_k=3, depth=3, total=8)):
        assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected


@pytest.mark.parametrize("agree", [0, 2, 5])
def test_the_device_chain_verdict_is_the_tree_walk(agree):
    """accept_chain_greedy (one read-back) accepts what walk_greedy accepts on the same chain, bonus included."""
    from eyas.engine.tree import chain_tree
    from eyas.engine.verify import accept_chain_greedy, walk_greedy

    generator = torch.Generator().manual_seed(agree)
    logits = torch.randn(6, 50, generator=generator)
    choice = logits.argmax(-1)
    drafts = choice[:5].clone()
    if agree < 5:
        drafts[agree] = (drafts[agree] + 1) % 50  # the first disagreement
    path, bonus = walk_greedy(chain_tree(7, drafts), logits)
    accepted, chain_bonus, ids = accept_chain_greedy(drafts, logits)
    assert (accepted, chain_bonus, ids) == (len(path) - 1, bonus, drafts.tolist()) and accepted == agree


@pytest.mark.parametrize("speculation", [Speculation("chain", 4), Speculation("tree", top_k=3, depth=4, total=12)],
                         ids=["chain", "tree"])
def test_bursts_run_whole_rounds_on_the_device_and_match_round_by_round(monkeypatch, speculation):
    """With static shapes, greedy chain and tree rounds run in device-resident bursts. A target that always
    says token 0 and a drafter whose guess (0, accepted, or other ids) follows the sign of one hidden unit
    give partial acceptances; the burst path must accept exactly what the round-by-round path does."""
    from eyas.engine.round_burst import RoundBurst

    model = ARCHITECTURES["llama"][0]()
    layout = discover_layout(model)
    with torch.no_grad():
        layout.norm.weight.zero_()  # final hidden 0 → all logits 0 → the argmax is token 0, always
    drafter = random_drafter(tiny_config(vocab_size=layout.vocab_size, draft_vocab_size=100), seed=3)
    drafter.load_target_embedding(layout.embed.weight)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
        drafter.lm_head.weight.zero_()
        # draft 0 first when unit 0 > 0; else 1 first, then ids of logit 0, and 0 last (out of a tree's top 3)
        drafter.lm_head.weight[0, 0], drafter.lm_head.weight[1, 0] = 1.0, -1.0
        drafter.d2t[0] = 0  # draft id 0 is target id 0 (accepted); every other draft id is another id (rejected)
    runs, in_flight = [], []
    monkeypatch.setattr(RoundBurst, "extend", lambda self, rounds, _extend=RoundBurst.extend: runs.append(rounds) or
                        _extend(self, rounds))
    monkeypatch.setattr(RoundBurst, "collect", lambda self, _collect=RoundBurst.collect: in_flight.append(
        len(self._queued)) or _collect(self))
    prompt = prompt_of(11)
    results, drafters = {}, {}
    for static in (False, True):
        target = TargetRunner(model, layout, None, 160, static)
        drafters[static] = DraftRunner(drafter, 160, static_shapes=static)
        results[static] = generate(target, prompt, 60, drafters[static], speculation)
    assert max(in_flight) == 2  # pipelined: the next burst was queued before the last one was read back
    monkeypatch.setattr(RoundBurst, "pipelined", False)
    in_flight.clear()
    target = TargetRunner(model, layout, None, 160, True)
    serial = generate(target, prompt, 60, DraftRunner(drafter, 160, static_shapes=True), speculation)
    assert max(in_flight) == 1
    eager, burst = results[False], results[True]
    assert (serial.tokens, serial.accepted) == (burst.tokens, burst.accepted)
    assert burst.tokens == eager.tokens == [0] * 60
    # The drafter committed the same states at the same slots (a burst may run past the end: compare the common part).
    committed = drafters[False].length
    assert drafters[True].length >= committed
    torch.testing.assert_close(drafters[True].keys[:, :, :committed], drafters[False].keys[:, :, :committed])
    assert burst.accepted == eager.accepted and 0 < eager.tau - 1 < 4  # partial acceptance, identical per round
    assert max(eager.accepted) > 1
    assert len(set(eager.accepted)) > 1 and runs and sum(runs) >= burst.rounds - 2  # nearly every round in bursts


class ReplayFirst:
    """Stands in for StepGraphs on the CPU with a CUDA graph's semantics: a key replays the function
    first recorded under it, bound to the buffers it closed over, whatever function is passed later."""

    def __init__(self):
        self.recorded = {}

    def ensure(self, key, step):
        if key in self.recorded:
            return False
        self.recorded[key] = step
        return True

    def run(self, key, step):
        return self.recorded.setdefault(key, step)()


def test_recorded_steps_stay_correct_across_generations():
    """Every recorded step (target forwards, drafter chains and tree levels, plain, chain and tree bursts) reads
    buffers that outlive one generation: a second prompt through the first recordings decodes right."""
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, static_shapes=True)
    target.graphs, drafter.graphs = ReplayFirst(), ReplayFirst()
    for seed in (21, 22):
        prompt = prompt_of(seed, length=8 + seed % 3)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        for speculation in (None, Speculation("chain", 4), Speculation("tree", top_k=4, depth=3, total=10)):
            assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected, (seed, speculation)
    bursts = {key[0] for key in target.graphs.recorded if isinstance(key, tuple)}
    assert {"ChainBurst", "TreeBurst"} <= bursts


@pytest.mark.parametrize("speculation", [Speculation("chain", 5), Speculation("tree", top_k=4, depth=5, total=20)],
                         ids=["chain", "tree"])
def test_caches_sized_as_the_cli_sizes_them_keep_every_greedy_round_in_bursts(monkeypatch, speculation):
    """eyas bench / generate size the target's cache to prompt + new tokens + draft tokens + 1, and the
    drafter's DRAFTER_SPARE slots larger: then no round of a greedy generation leaves the bursts (a
    host-driven round near the end would, on a GPU, record or compile its shapes mid-generation)."""
    from eyas.engine.loading import DRAFTER_SPARE

    model = ARCHITECTURES["llama"][0]()
    prompt, new_tokens = prompt_of(5), 40
    capacity = prompt.shape[1] + new_tokens + speculation.draft_tokens + 1
    target, _ = runners(model, capacity=capacity, static_shapes=True)
    _, drafter = runners(model, capacity=capacity + DRAFTER_SPARE, static_shapes=True)
    host_rounds = []
    for name in ("draft_tree", "chain_tree", "accept_chain_greedy"):
        monkeypatch.setattr(decode, name, lambda *a, _f=getattr(decode, name): host_rounds.append(1) or _f(*a))
    generation = generate(target, prompt, new_tokens, drafter, speculation)
    assert generation.tokens == reference_greedy(model, prompt, new_tokens)
    assert not host_rounds and generation.rounds > 1
