"""EAGLE-2 trees are lossless too, and speculative sampling keeps the target's distribution.

Greedy trees (every architecture: test_engine_greedy.py): here the dynamic tree's shape and masks,
its agreement with chained drafting, and an oracle tree that hides the right token behind wrong
siblings, so accepted nodes sit at scattered slots and must be compacted.
Sampling: chi-square tests of the acceptance walk against the target distribution, alone (many
draws, exact rule) and through the whole engine.
"""

import pytest
import torch

import eyas.engine.decode as decode
from eyas.engine.decode import Speculation, generate
from eyas.engine.draft_runner import DraftRunner
from eyas.engine.tree import DraftTree, ancestor_mask, draft_tree
from eyas.engine.verify import Sampling, sample, target_probs, walk_sampling
from test_engine_greedy import NEW_TOKENS, prompt_of, reference_greedy, runners
from zoo import ARCHITECTURES

TREE = Speculation("tree", top_k=4, depth=3, total=10)


def test_dynamic_tree_shape_and_masks():
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    aux = torch.randn(1, 6, drafter.drafter.config.aux_width)
    tree = draft_tree(drafter, aux, torch.randint(0, 256, (1, 6)), torch.arange(6).unsqueeze(0), root=7,
                      top_k=4, depth=3, total=10)
    assert len(tree) == 11 and int(tree.tokens[0]) == 7
    assert all(int(tree.parents[i]) < i for i in range(1, 11))  # parents first: the mask can be built in one pass
    assert all(int(tree.depths[i]) == int(tree.depths[tree.parents[i]]) + 1 for i in range(1, 11))
    assert int(tree.depths.max()) <= 3
    assert drafter.speculative == 0 and drafter.length == 6  # drafted entries rolled back, the states committed
    # what the host walks read: each node's children, in tree order
    assert tree.child_lists() == [(tree.parents == i).nonzero().flatten().tolist() for i in range(11)]
    mask = ancestor_mask(tree.parents)
    for i in range(11):
        expected, node = {i}, i
        while node > 0:
            node = int(tree.parents[node])
            expected.add(node)
        assert set(mask[i].nonzero().flatten().tolist()) == expected


def test_tree_nodes_match_the_chained_drafter():
    """With every proposal kept, the best-child path is the greedy chain: per-node tree attention = the chain's."""
    model = ARCHITECTURES["llama"][0]()
    _, drafter = runners(model)
    gen = torch.Generator().manual_seed(4)
    aux = torch.randn(1, 6, drafter.drafter.config.aux_width, generator=gen)
    tokens = torch.randint(0, 256, (1, 6), generator=gen)
    positions = torch.arange(6).unsqueeze(0)
    chain = drafter.draft_chain(aux, tokens, positions, 3)
    drafter.reset()
    tree = draft_tree(drafter, aux, tokens, positions, root=int(tokens[0, -1]), top_k=3, depth=3, total=21)
    node, path, children = 0, [], tree.child_lists()
    for _ in range(3):
        node = children[node][0]  # children are stored best first
        path.append(int(tree.tokens[node]))
    assert path == chain.tolist()


def test_scattered_accepted_nodes_are_compacted(monkeypatch):
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompt = prompt_of(9)
    expected = reference_greedy(model, prompt, NEW_TOKENS + 8)
    emitted = []

    def oracle_tree(drafter, aux, next_tokens, positions, root, top_k, depth, total):
        done = int(positions[0, -1]) + 2 - prompt.shape[1]
        right = expected[done : done + 3]
        wrong = [(t + 1) % 256 for t in right]
        # root → [wrong0, right0]; right0 → [wrong1, wrong1+1, right1]; right1 → [right2]
        tokens = [root, wrong[0], right[0], wrong[1], (wrong[1] + 1) % 256, right[1], right[2]]
        parents = [-1, 0, 0, 2, 2, 2, 5]
        depths = [0, 1, 1, 2, 2, 2, 3]
        emitted.append(right)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))

    monkeypatch.setattr(decode, "draft_tree", oracle_tree)
    generation = generate(target, prompt, NEW_TOKENS, drafter, TREE)
    assert generation.tokens == expected[:NEW_TOKENS]
    assert generation.accepted == [3] * generation.rounds  # nodes 2, 5, 6: slots moved down each round


@pytest.mark.parametrize("seed", range(6))
def test_the_device_tree_verdict_is_the_tree_walk(seed):
    """tree_verdict (no host synchronisation, what a tree burst runs) accepts the path walk_greedy accepts,
    with its bonus, on dynamic trees whose target agrees down a random branch for a random depth."""
    from eyas.engine.verify import tree_verdict, walk_greedy

    model = ARCHITECTURES["llama"][0]()
    _, drafter = runners(model)
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 5, drafter.drafter.config.aux_width, generator=gen)
    tree = draft_tree(drafter, aux, torch.randint(0, 256, (1, 5), generator=gen), torch.arange(5).unsqueeze(0),
                      root=7, top_k=3, depth=4, total=14)
    logits = torch.randn(len(tree), 256, generator=gen)
    node = int(torch.randint(0, len(tree), (1,), generator=gen))  # the target agrees down to this node
    while node > 0:
        parent = int(tree.parents[node])
        logits[parent, int(tree.tokens[node])] = 100.0
        node = parent
    path, bonus = walk_greedy(tree, logits)
    accepted, device_bonus, device_path = tree_verdict(tree.tokens, tree.parents, tree.depths, logits, 4)
    assert int(accepted) == len(path) - 1 and int(device_bonus) == bonus
    assert device_path[: len(path)].tolist() == path


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test, categories with expected count < 5 lumped together."""
    total = observed.sum()
    expected = expected_probs * total
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    statistic = (((obs - exp) ** 2) / exp)[keep].sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def test_acceptance_walk_emits_the_target_distribution():
    vocab, draws = 6, 20000
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, vocab, generator=gen) * 1.5, -1)
    # root → children tokens 2, 0, 5 (nodes 1-3); node 1 (token 2) → child token 4 (node 4)
    tree = DraftTree(torch.tensor([9, 2, 0, 5, 4]), torch.tensor([-1, 0, 0, 0, 1]), torch.tensor([0, 1, 1, 1, 2]))
    probs = torch.cat([probs, probs[1:2]])  # node 4's distribution: any distribution will do
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # after the first token was 2 (node 1 accepted)
    for _ in range(draws):
        path, bonus = walk_sampling(tree, probs, gen)
        emitted = [int(tree.tokens[n]) for n in path[1:]] + [bonus]
        first[emitted[0]] += 1
        if len(path) > 1 and path[1] == 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, probs[0]) > 1e-3
    assert chi_square_p(second, probs[1]) > 1e-3
    # the test has power: a wrong rule (always accept the first child) is rejected outright
    assert chi_square_p(torch.tensor([0, 0, draws, 0, 0, 0], dtype=torch.float), probs[0]) < 1e-6


def test_sample_follows_unnormalised_weights_and_never_picks_a_zero():
    gen = torch.Generator().manual_seed(1)
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5])  # sums to 7: sample renormalises
    counts = torch.zeros(len(weights))
    for _ in range(14000):
        counts[sample(weights, gen)] += 1
    assert counts[weights == 0].sum() == 0
    assert chi_square_p(counts, weights / weights.sum()) > 1e-3
    # one seed, one stream of draws: the same tokens again
    runs = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)]
    assert [sample(weights, runs[0]) for _ in range(50)] == [sample(weights, runs[1]) for _ in range(50)]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.7)), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.8)), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.81)), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


class FixedProposals(DraftRunner):
    """Proposes fixed drafts (for a chain) whatever the context: verification must stay lossless anyway."""

    def __init__(self, base: DraftRunner, drafts: list[int]):
        super().__init__(base.drafter, base.capacity)
        self.drafts = drafts

    def draft_chain(self, aux, next_tokens, positions, steps):
        return torch.tensor(self.drafts[:steps])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_sampling_follows_the_target_end_to_end(mode, monkeypatch):
    """The token decided by the acceptance walk vs the target's exact distribution, through the engine.

    Drafts are the target's two likeliest tokens, so they are often accepted and often rejected.
    """
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    sampling = Sampling(temperature=0.05)  # a random tiny model is flat: sharpen it
    with torch.no_grad():
        first_probs = target_probs(model(prompt).logits[0, -1], sampling)
        first = int(first_probs.argmax())
        second_probs = target_probs(model(torch.cat([prompt, torch.tensor([[first]])], 1)).logits[0, -1], sampling)
    likely = second_probs.topk(2).indices.tolist()
    if mode == "chain":
        drafter, speculation = FixedProposals(drafter, [likely[0], 0, 0]), Speculation("chain", 3)
    else:
        speculation = TREE
        monkeypatch.setattr(decode, "draft_tree", lambda d, a, t, p, root, *args: DraftTree(
            torch.tensor([root, likely[1], likely[0]]), torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1])))
    counts, accepted = torch.zeros(256), 0
    for seed in range(800):
        g = generate(target, prompt, 2, drafter, speculation, Sampling(temperature=0.05, seed=seed))
        if g.tokens[0] == first:
            counts[g.tokens[1]] += 1
            accepted += g.accepted[0]
    assert counts.sum() > 200, "the prefill token is rarely the likeliest: pick another prompt"
    assert 0.1 < accepted / counts.sum() < 0.95  # both acceptance and rejection were exercised
    assert chi_square_p(counts, second_probs) > 1e-3
