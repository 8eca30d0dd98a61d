"""The engine's greedy decoding is lossless: chain and tree output == plain output == the target's own greedy.

The reference is the most independent one there is: the full prefix re-run through the HF model
without any cache, argmax, append (and transformers' ``generate`` where the model has one). A
random drafter checks the no-acceptance path on every architecture; an oracle drafter that is right
for exactly the first j drafts checks acceptance, the bonus token, cache commits and τ accounting,
whose values are then known in advance.
"""

import pytest
import torch

import eyas.engine.burst as burst_module
from eyas.engine.burst import Burst
from eyas.engine.decode import generate, round_for
from eyas.speculation import Chain, Sampling, Tree
from eyas.families.eagle3.runner import DraftRunner
from eyas.engine.proposers import GreedyChain
from eyas.engine.round import Draft, Round
from eyas.engine.target_runner import TargetRunner
from eyas.target.layout import discover_layout
from test_drafter_consistency import random_drafter, tiny_config
from zoo import ARCHITECTURES

NEW_TOKENS = 24
CHAIN = Chain(4)
TREE = Tree(top_k=4, depth=3, total=10)


def reference_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


def runners(model, capacity=128, seed=0):
    layout = discover_layout(model)
    drafter = random_drafter(tiny_config(vocab_size=layout.vocab_size, draft_vocab_size=100), seed=seed)
    drafter.load_target_embedding(layout.embed.weight)
    return TargetRunner(model, layout, None, capacity), DraftRunner(drafter, capacity)


def prompt_of(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(1, 240, (1, length), generator=torch.Generator().manual_seed(seed))


def emitted_so_far(decoding_round: Round, prompt_length: int) -> int:
    """Tokens emitted before this round (on the CPU the round's numbers can be read): the committed ones after
    the prompt, plus the root."""
    return int(decoding_round.state.target_length) - prompt_length + 1


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_speculation_is_lossless_on_every_architecture(arch):
    model = ARCHITECTURES[arch][0]()
    target, drafter = runners(model)
    for seed in range(2):
        prompt = prompt_of(seed)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        plain = generate(target, prompt, NEW_TOKENS)
        chain = generate(target, prompt, NEW_TOKENS, drafter, CHAIN)
        tree = generate(target, prompt, NEW_TOKENS, drafter, TREE)
        assert plain.tokens == expected, f"{arch}: plain decoding differs from the uncached reference"
        assert chain.tokens == expected, f"{arch}: chain speculation differs from the uncached reference"
        assert tree.tokens == expected, f"{arch}: tree speculation differs from the uncached reference"
        if hasattr(model, "generate") and arch != "qwen2_5_vl":  # its generate needs multimodal rope inputs
            hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False)
            assert hf[0, prompt.shape[1] :].tolist() == expected


class ReplayFirst:
    """Stands in for StepGraphs on the CPU with a CUDA graph's semantics: a key replays the function
    first recorded under it, bound to the buffers it closed over, whatever function is passed later."""

    enabled = True

    def __init__(self):
        self.recorded = {}

    def has(self, key):
        return key in self.recorded

    def ensure(self, key, step):
        if key in self.recorded:
            return False
        self.recorded[key] = step
        step()  # a recording's warm-up runs really execute
        return True

    def run(self, key, step):
        return self.recorded.setdefault(key, step)()


def test_recordings_are_per_round_kind_and_stay_correct_across_generations():
    """With (fake) CUDA graphs, what is recorded — one greedy round per mode, one sampled round per mode and rule, a
    prefill per bucket — is replayed for every later prompt, whatever its length or its acceptances: each
    recording reads buffers that outlive one generation, and its warm-up runs leave no trace in the output (a
    sampled generation equals the same seed's without recordings)."""
    from eyas.engine.acceptance import Sampling

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    eager_target, eager_drafter = runners(model)
    target.graphs = target.prefill_graphs = ReplayFirst()
    target.bucketed_prefill = True
    target.prefill(prompt_of(0, length=3))  # the first forward allocates the cache: never recorded
    for seed, length in ((21, 8), (22, 9), (23, 13)):
        prompt = prompt_of(seed, length)
        expected = reference_greedy(model, prompt, NEW_TOKENS)
        for speculation in (None, CHAIN, TREE):
            assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected, (seed, speculation)
            sampling = Sampling(temperature=1.0, seed=seed)
            sampled = generate(target, prompt, 6, drafter, speculation, sampling)
            assert sampled == generate(eager_target, prompt, 6, eager_drafter, speculation, sampling), (seed, speculation)
    kinds = sorted(str(key[:2]) for key in target.graphs.recorded if isinstance(key, tuple))
    assert kinds == sorted(str((step, mode)) for mode in ("plain", "chain", "tree")
                           for step in ("burst", ("burst", Sampling(temperature=1.0).resolved(mode).recorded)))
    assert sorted(key for key in target.graphs.recorded if isinstance(key, int)) == [16]  # 8, 9 and 13 share a bucket


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_a_padded_prefill_equals_the_eager_one(arch):
    """With graphs a prompt is padded to its bucket and runs as one fixed-shape step over the whole cache: the
    last token's logits and every prompt token's aux states are the eager prefill's, and a prompt longer than
    the largest bucket still runs (eagerly)."""
    model = ARCHITECTURES[arch][0]()
    eager, _ = runners(model)
    padded, _ = runners(model)
    padded.bucketed_prefill = True
    padded.prefill(prompt_of(0, length=5))  # the first forward: allocates, not padded
    assert not padded._prefill_inputs
    for seed, length in ((1, 9), (2, 16), (3, 23)):
        prompt = prompt_of(seed, length)
        expected_logits, expected_aux = (t.clone() for t in eager.prefill(prompt))
        logits, aux = padded.prefill(prompt)
        assert padded.length == length
        assert torch.allclose(logits, expected_logits, atol=1e-5), (arch, length)
        assert torch.allclose(aux, expected_aux, atol=1e-5), (arch, length)
    assert set(padded._prefill_inputs) == {16, 32}  # 9 and 16 share a bucket
    padded.PREFILL_BUCKETS = (16,)
    long_prompt = prompt_of(4, 20)
    assert torch.allclose(padded.prefill(long_prompt)[0], eager.prefill(long_prompt)[0], atol=1e-5)
    assert generate(padded, long_prompt, 8).tokens == reference_greedy(model, long_prompt, 8)


def oracle_chain(monkeypatch, continuation: list[int], prompt_length: int, wrong_at: int) -> None:
    """Every chain round drafts the true greedy continuation, except that draft ``wrong_at`` is wrong. The real
    drafter still runs (its cache bookkeeping is exercised); only its proposals are replaced."""
    real = GreedyChain.propose

    def propose(self, decoding_round, uniforms):
        proposed, _ = real(self, decoding_round, uniforms)
        done = emitted_so_far(decoding_round, prompt_length)
        drafts = [continuation[min(done + i, len(continuation) - 1)] for i in range(len(proposed.tokens) - 1)]
        if wrong_at < len(drafts):
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 256
        return Draft(torch.cat([proposed.tokens[:1], torch.tensor(drafts)]), proposed.positions), None

    monkeypatch.setattr(GreedyChain, "propose", propose)


@pytest.mark.parametrize("wrong_at", [0, 2, 5])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_accepted_drafts_commit_correctly_and_tau_counts_them(arch, wrong_at, monkeypatch):
    model = ARCHITECTURES[arch][0]()
    target, drafter = runners(model)
    prompt = prompt_of(7)
    expected = reference_greedy(model, prompt, NEW_TOKENS + 8)
    oracle_chain(monkeypatch, expected, prompt.shape[1], wrong_at)
    chain = generate(target, prompt, NEW_TOKENS, drafter, Chain(5))
    assert chain.tokens == expected[:NEW_TOKENS]
    accepted = min(wrong_at, 5)  # every round accepts exactly the drafts before the wrong one
    assert chain.accepted == [accepted] * chain.rounds
    assert chain.rounds == -(-(NEW_TOKENS - 1) // (accepted + 1))  # the first token comes from the prefill
    assert chain.tau == 1 + accepted
    assert chain.accepted_at() == [1.0] * accepted + [0.0] * (5 - accepted)


def test_generation_stops_at_a_stop_token_and_keeps_it(monkeypatch):
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompt = prompt_of(3)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    stop = expected[5]
    first = expected.index(stop)
    assert generate(target, prompt, NEW_TOKENS, stop_ids=[stop]).tokens == expected[: first + 1]
    oracle_chain(monkeypatch, expected + [0] * 8, prompt.shape[1], 9)
    assert generate(target, prompt, NEW_TOKENS, drafter, CHAIN, stop_ids=[stop]).tokens == expected[: first + 1]


@pytest.mark.parametrize("speculation", [None, CHAIN], ids=["plain", "chain"])
def test_a_sequence_longer_than_the_cache_is_refused_with_advice(speculation):
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=16)
    with pytest.raises(Exception, match="raise max_length"):
        generate(target, prompt_of(0), NEW_TOKENS, drafter, speculation)


def test_plain_greedy_decodes_in_bursts_and_commits_every_token(monkeypatch):
    """Plain greedy decoding is rounds with nothing drafted, max_rounds a burst, each burst queued from the state
    the last one left on the device."""
    monkeypatch.setitem(burst_module.MAX_ROUNDS, "plain", 5)
    model = ARCHITECTURES["llama"][0]()
    target, _ = runners(model)
    calls = []
    monkeypatch.setattr(Burst, "extend", lambda self, rounds, _extend=Burst.extend: calls.append(rounds) or _extend(self, rounds))
    prompt = prompt_of(8)
    assert generate(target, prompt, NEW_TOKENS).tokens == reference_greedy(model, prompt, NEW_TOKENS)
    assert calls == [5, 5, 5, 5, 3]  # 24 new tokens: the first from the prefill, then 23 rounds
    assert target.length == prompt.shape[1] + NEW_TOKENS - 1  # every run token committed (the last is emitted only)


@pytest.mark.parametrize("static_window", [False, True])
def test_a_window_on_every_layer_is_honoured(static_window):
    """Mistral-style: a sliding window and no layer types means every layer slides (as HF's forward does);
    with a window shorter than the sequence, decoding must still equal the uncached reference."""
    from transformers import MistralConfig, MistralForCausalLM

    from zoo import _TEXT, _seeded

    model = _seeded(lambda: MistralForCausalLM(MistralConfig(**_TEXT, sliding_window=6)))
    target, drafter = runners(model)
    target.bucketed_prefill = static_window  # the padded prefill builds its window over the whole cache
    assert target.sliding_everywhere
    prompt = prompt_of(1)
    expected = reference_greedy(model, prompt, NEW_TOKENS)
    for speculation in (None, Chain(3), Tree(top_k=3, depth=3, total=8)):
        assert generate(target, prompt, NEW_TOKENS, drafter, speculation).tokens == expected


def path_agreeing(tokens: list[int], parents: list[int], choice: list[int]) -> list[int]:
    """The greedy rule written plainly: from the root, follow the child whose token is the argmax; stop where none is."""
    path = [0]
    while True:
        follow = [c for c, p in enumerate(parents) if p == path[-1] and tokens[c] == choice[path[-1]]]
        if not follow:
            return path
        path.append(follow[0])


@pytest.mark.parametrize("agree", [0, 2, 5])
def test_the_chain_verdict_accepts_the_longest_agreeing_prefix(agree):
    from eyas.engine.acceptance import chain_verdict

    generator = torch.Generator().manual_seed(agree)
    logits = torch.randn(6, 50, generator=generator)
    choice = logits.argmax(-1)
    drafts = choice[:5].clone()
    if agree < 5:
        drafts[agree] = (drafts[agree] + 1) % 50  # the first disagreement
    path = path_agreeing([7, *drafts.tolist()], list(range(-1, 5)), choice.tolist())
    accepted, bonus = chain_verdict(drafts, logits)
    assert int(accepted) == len(path) - 1 == agree and int(bonus) == int(choice[path[-1]])


def constant_pair(seed=3):
    """A llama target that always says token 0, and a drafter whose guess (0, accepted, or other ids) follows the
    sign of one hidden unit: partial acceptances, different from round to round."""
    model = ARCHITECTURES["llama"][0]()
    layout = discover_layout(model)
    with torch.no_grad():
        layout.norm.weight.zero_()  # final hidden 0 → all logits 0 → the argmax is token 0, always
    drafter = random_drafter(tiny_config(vocab_size=layout.vocab_size, draft_vocab_size=100), seed=seed)
    drafter.load_target_embedding(layout.embed.weight)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
        drafter.lm_head.weight.zero_()
        # draft 0 first when unit 0 > 0; else 1 first, then ids of logit 0, and 0 last (out of a tree's top 3)
        drafter.lm_head.weight[0, 0], drafter.lm_head.weight[1, 0] = 1.0, -1.0
        drafter.d2t[0] = 0  # draft id 0 is target id 0 (accepted); every other draft id is another id (rejected)
    return model, layout, drafter


@pytest.mark.parametrize("speculation", [Chain(4), Tree(top_k=3, depth=4, total=12)],
                         ids=["chain", "tree"])
def test_bursts_emit_what_rounds_run_one_by_one_emit(monkeypatch, speculation):
    """Pipelined bursts (two in flight), serial bursts and the rounds run one at a time with their state read
    after each give the same tokens and the same acceptance, round for round, with partial acceptances."""
    model, layout, drafter = constant_pair()
    prompt = prompt_of(11)
    in_flight = []
    monkeypatch.setattr(Burst, "collect", lambda self, _collect=Burst.collect: in_flight.append(self.in_flight) or _collect(self))
    results = {}
    for pipelined in (True, False):
        monkeypatch.setattr(Burst, "pipelined", pipelined)
        in_flight.clear()
        target = TargetRunner(model, layout, None, 160)
        results[pipelined] = generate(target, prompt, 60, DraftRunner(drafter, 160), speculation)
        assert max(in_flight) == (2 if pipelined else 1)
    target = TargetRunner(model, layout, None, 160)
    logits, aux = target.prefill(prompt)
    decoding_round, _ = round_for(target, DraftRunner(drafter, 160), speculation)
    decoding_round.begin(prompt, aux, int(logits.argmax()))
    tokens, accepted = [int(logits.argmax())], []
    while len(tokens) < 60:
        with torch.no_grad():
            new, count, _ = decoding_round.run(decoding_round.decoder(Sampling()))
        accepted.append(int(count))
        tokens += new[: int(count) + 1].tolist()
    for result in results.values():
        assert result.tokens == tokens[:60] == [0] * 60
        assert result.accepted == accepted[: result.rounds]
    assert 0 < results[True].tau - 1 < speculation.max_depth and len(set(accepted)) > 1 and max(accepted) > 1


@pytest.mark.parametrize("speculation", [Chain(5), Tree(top_k=4, depth=5, total=20)],
                         ids=["chain", "tree"])
def test_caches_sized_as_the_cli_sizes_them_hold_every_round(speculation):
    """eyas bench / generate size the target's cache to prompt + new tokens + draft tokens + 1, and the drafter's
    DRAFTER_SPARE slots larger: then every round of a greedy generation fits, whatever it accepts."""
    from eyas.engine.modes import DRAFTER_SPARE

    model, layout, drafter = constant_pair()
    prompt, new_tokens = prompt_of(5), 40
    capacity = prompt.shape[1] + new_tokens + speculation.draft_tokens + 1
    target = TargetRunner(model, layout, None, capacity)
    generation = generate(target, prompt, new_tokens, DraftRunner(drafter, capacity + DRAFTER_SPARE), speculation)
    assert generation.tokens == [0] * new_tokens and generation.rounds > 1
    with pytest.raises(Exception, match="raise max_length"):  # a drafter cache short of the answer: refused, not overrun
        generate(TargetRunner(model, layout, None, capacity), prompt, new_tokens,
                 DraftRunner(drafter, capacity - new_tokens // 2), speculation)


def test_warm_up_starts_a_generation_at_every_prompt_length(monkeypatch):
    """What a timed prompt would otherwise do first: each distinct prompt length is prefilled and committed to the
    drafter in the warm-up (on a GPU the drafter's eager attention prepares itself per new length), and the
    warm-up leaves decoding as it found it: the same answers afterwards."""
    from eyas.engine.acceptance import Sampling
    from eyas.engine.decode import warm_up

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompts = [prompt_of(1, 7), prompt_of(2, 12), prompt_of(3, 7), prompt_of(4, 19)]
    before = [generate(target, p, 12, drafter, CHAIN).tokens for p in prompts]
    committed = []
    commit_prompt = DraftRunner.commit_prompt
    monkeypatch.setattr(DraftRunner, "commit_prompt",
                        lambda self, aux, *rest: committed.append(aux.shape[1] + 1) or commit_prompt(self, aux, *rest))
    warm_up(target, prompts, [(None, Sampling()), (CHAIN, Sampling())], drafter)
    assert sorted(set(committed)) == [7, 12, 19]
    assert committed.count(12) == committed.count(19) == 1  # each other length once, by the first speculating decoder
    monkeypatch.undo()
    assert [generate(target, p, 12, drafter, CHAIN).tokens for p in prompts] == before

    committed.clear()  # no decoder speculates: prefills only
    monkeypatch.setattr(DraftRunner, "commit_prompt", lambda self, aux, *rest: committed.append(aux.shape[1] + 1))
    warm_up(target, prompts, [(None, Sampling())], drafter)
    assert committed == []


@pytest.mark.parametrize("top_k,depth,total", [(4, 3, 10), (10, 7, 60), (3, 5, 200)])
def test_a_tree_picks_the_same_proposals_by_pairs_as_by_sorting(top_k, depth, total):
    """select's pairwise ranking (a tree's proposals, up to PAIRWISE_MOST) chooses and orders exactly what a stable
    sort does, ties included: scores drawn from a few values tie everywhere."""
    from eyas.engine.drafting import _best_by_pairs, _best_by_sort, proposal_depths, select
    from eyas.engine.modes import tree_size

    depths = proposal_depths(top_k, depth)
    count = tree_size(top_k, depth, total)
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        values = 3 if seed % 2 else 1000  # many ties, or few
        scores = -torch.randint(0, values, (len(depths),), generator=generator).float() / 7
        if seed % 5 == 0:
            scores[::3] = float("-inf")  # log-probs that underflowed
        assert torch.equal(_best_by_pairs(scores, depths, count), _best_by_sort(scores, depths, count))
    ids = torch.arange(len(depths))
    parents = torch.cat([torch.full((top_k,), -1), torch.arange(len(depths) - top_k) // top_k])
    _, _, tree_depths = select(ids, parents, scores, depths, torch.zeros(len(depths), dtype=torch.long), total)
    assert torch.equal(tree_depths, torch.sort(tree_depths).values)


def test_an_eager_prefill_computes_only_the_last_tokens_logits():
    """A prefill that runs eagerly (a prompt past the recorded buckets, or no graphs) asks the target's head for the
    last prompt token's logits only — a long prompt's [P, V] would cost a head matmul and memory over every prompt
    token (8,192 × 49,152 for the demo target) — and they are the full forward's last row."""
    from zoo import llama

    torch.manual_seed(0)
    model = llama().float().eval()
    prompt = torch.randint(1, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        expected = model(prompt).logits[0, -1]
    heads = []
    model.lm_head.register_forward_hook(lambda module, args, out: heads.append(tuple(out.shape)))
    target = TargetRunner(model, discover_layout(model), None, 64)
    logits, aux = target.prefill(prompt)
    assert heads == [(1, 1, model.config.vocab_size)] and aux.shape[1] == 40
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    target.close()


def test_an_eager_prefill_attends_causally_with_no_prompt_square_mask(monkeypatch):
    """An SDPA target's eager prefill asks transformers' SDPA attention for causal attention over the prompt alone (no
    mask, so its flash kernels may run) in every layer, and builds no [P, P] mask; its logits and aux states are those
    of the explicit mask's prefill. A target whose layers slide a window keeps the explicit mask."""
    import transformers.integrations.sdpa_attention as sdpa
    from eyas.engine import attention
    from zoo import gemma3_text, llama

    calls, masks = [], []
    real_sdpa, real_mask = sdpa.sdpa_attention_forward, attention.additive_mask
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda module, q, k, v, mask, *a, **kw: (
        calls.append((q.shape[2], k.shape[2], mask is None, kw.get("is_causal"))), real_sdpa(module, q, k, v, mask, *a, **kw))[1])
    monkeypatch.setattr(attention, "additive_mask", lambda visible, dtype: (masks.append(tuple(visible.shape)),
                                                                            real_mask(visible, dtype))[1])
    torch.manual_seed(0)
    model = llama().float().eval()
    prompt = torch.randint(1, model.config.vocab_size, (1, 40))
    causal = TargetRunner(model, discover_layout(model), None, 64)
    logits, aux = (t.clone() for t in causal.prefill(prompt))
    assert calls == [(40, 40, True, True)] * model.config.num_hidden_layers and masks == []
    causal.close()
    explicit = TargetRunner(model, discover_layout(model), None, 64)
    explicit._causal_prefill = False
    expected_logits, expected_aux = explicit.prefill(prompt)
    assert masks == [(40, 40)]
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, expected_aux, rtol=1e-5, atol=1e-5)
    explicit.close()
    calls.clear()
    windowed_model = gemma3_text().float().eval()
    windowed = TargetRunner(windowed_model, discover_layout(windowed_model), None, 64)
    windowed.prefill(prompt % 200 + 1)
    assert not windowed._causal_prefill and calls == []
    windowed.close()


def test_causal_attention_over_a_longer_cache_sees_each_querys_own_past():
    """Keys that are not the queries' own (earlier tokens before them) get the causal mask built for the call: each of
    the n queries, the last n positions, sees the keys up to its own."""
    from torch import nn

    from eyas.engine.causal_prefill import causal_sdpa

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 7, 8), torch.randn(1, 4, 7, 8)
    out, _ = causal_sdpa(nn.Module(), q, k, v, None, scaling=8 ** -0.5)
    seen = torch.ones(3, 7, dtype=torch.bool).tril(4)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen).transpose(1, 2)
    torch.testing.assert_close(out, expected)
