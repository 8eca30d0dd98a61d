"""EAGLE-2 trees are lossless too, and speculative sampling keeps the target's distribution.

Greedy trees (every architecture: test_engine_greedy.py): here the dynamic tree's shape and masks,
its agreement with chained drafting, and an oracle tree that hides the right token behind wrong
siblings, so accepted nodes sit at scattered slots and must be compacted.
Sampling: chi-square tests of the acceptance walk against the target distribution, alone (many
draws, exact rule) and through the whole engine.
"""

import pytest
import torch

from eyas.engine.acceptance import Sampling, draw, target_probs, tree_sampled, tree_verdict
from eyas.engine.decode import generate, round_for
from eyas.speculation import Chain, Tree
from eyas.engine.drafting import ancestor_mask
from eyas.engine.proposers import GreedyChain, TopKTree
from eyas.engine.round import Draft
from test_engine_greedy import NEW_TOKENS, TREE, emitted_so_far, path_agreeing, prompt_of, reference_greedy, runners
from zoo import ARCHITECTURES


def first_draft(target, drafter, speculation, prompt):
    """The draft of a generation's first round after ``prompt``."""
    logits, aux = target.prefill(prompt)
    decoding_round, _ = round_for(target, drafter, speculation)
    decoding_round.begin(prompt, aux, int(logits.argmax()))
    return decoding_round.decoder(Sampling()).proposer.propose(decoding_round, None)[0]


def test_dynamic_tree_shape_and_masks():
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompt = prompt_of(2, length=6)
    tree = first_draft(target, drafter, TREE, prompt)
    assert len(tree.tokens) == 11 and int(tree.tokens[0]) == int(target.prefill(prompt)[0].argmax())
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert all(parents[i] < i for i in range(1, 11))  # parents first: the mask can be built in one pass
    assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, 11))
    assert max(depths) <= 3 and torch.equal(tree.positions, 6 + tree.depths)
    assert drafter.length == 5  # the prompt's states but the last, committed; the round commits the last
    mask = ancestor_mask(tree.parents)
    for i in range(11):
        expected, node = {i}, i
        while node > 0:
            node = parents[node]
            expected.add(node)
        assert set(mask[i].nonzero().flatten().tolist()) == expected


def test_tree_nodes_match_the_chained_drafter():
    """With every proposal kept, the best-child path is the greedy chain: per-node tree attention = the chain's."""
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompt = prompt_of(4, length=6)
    chain = first_draft(target, drafter, Chain(3), prompt)
    tree = first_draft(target, drafter, Tree(top_k=3, depth=3, total=21), prompt)
    node, path, parents = 0, [], tree.parents.tolist()
    for _ in range(3):
        node = parents.index(node)  # children are stored best first
        path.append(int(tree.tokens[node]))
    assert path == chain.tokens[1:].tolist()


def test_scattered_accepted_nodes_are_compacted(monkeypatch):
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    prompt = prompt_of(9)
    expected = reference_greedy(model, prompt, NEW_TOKENS + 8)

    def oracle_tree(self):
        done = emitted_so_far(self, prompt.shape[1])
        right = (expected + [0] * 128)[done : done + 3]  # a burst may run rounds past the end: any tokens do there
        wrong = [(t + 1) % 256 for t in right]
        # root → [wrong0, right0]; right0 → [wrong1, wrong1+1, right1]; right1 → [right2]
        tokens = torch.tensor([int(self.state.root), wrong[0], right[0], wrong[1], (wrong[1] + 1) % 256, right[1], right[2]])
        depths = torch.tensor([0, 1, 1, 2, 2, 2, 3])
        return Draft(tokens, self.state.target_length + depths, torch.tensor([-1, 0, 0, 2, 2, 2, 5]), depths)

    monkeypatch.setattr(TopKTree, "propose", lambda proposer, decoding_round, uniforms: (oracle_tree(decoding_round), None))
    generation = generate(target, prompt, NEW_TOKENS, drafter, TREE)
    assert generation.tokens == expected[:NEW_TOKENS]
    assert generation.accepted == [3] * generation.rounds  # nodes 2, 5, 6: slots moved down each round


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_verdict_follows_the_greedy_rule(seed):
    """tree_verdict (no host synchronisation, what a greedy tree round runs) accepts the path the greedy rule
    accepts, with its bonus, on dynamic trees whose target agrees down a random branch for a random depth."""
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model)
    gen = torch.Generator().manual_seed(seed)
    tree = first_draft(target, drafter, Tree(top_k=3, depth=4, total=14), prompt_of(seed, length=5))
    logits = torch.randn(len(tree.tokens), 256, generator=gen)
    node = int(torch.randint(0, len(tree.tokens), (1,), generator=gen))  # the target agrees down to this node
    while node > 0:
        parent = int(tree.parents[node])
        logits[parent, int(tree.tokens[node])] = 100.0
        node = parent
    path = path_agreeing(tree.tokens.tolist(), tree.parents.tolist(), logits.argmax(-1).tolist())
    accepted, bonus, device_path = tree_verdict(tree.tokens, tree.parents, tree.depths, logits, 4)
    assert int(accepted) == len(path) - 1 and int(bonus) == int(logits[path[-1]].argmax())
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


def first_two_distributions(model, prompt: torch.Tensor, sampling: Sampling) -> tuple[int, torch.Tensor]:
    """The target's likeliest first token after ``prompt`` and its distribution of the second token after that one."""
    with torch.no_grad():
        first = int(target_probs(model(prompt).logits[0, -1], sampling).argmax())
        second = target_probs(model(torch.cat([prompt, torch.tensor([[first]])], 1)).logits[0, -1], sampling)
    return first, second


def assert_second_token_follows(run, first: int, second_probs: torch.Tensor, seeds: int, least: int) -> None:
    """The check of every sampled-round test: ``run(seed)`` decodes two tokens; among the runs whose first token is
    ``first``, the second follows ``second_probs`` (χ²), and the first round both accepted and rejected drafts."""
    counts, accepted = torch.zeros(len(second_probs)), 0
    for seed in range(seeds):
        g = run(seed)
        if g.tokens[0] == first:
            counts[g.tokens[1]] += 1
            accepted += g.accepted[0]
    assert counts.sum() > least, "the prefill token is rarely the likeliest: pick another prompt"
    assert 0.1 < accepted / counts.sum() < 0.95  # both acceptance and rejection were exercised
    assert chi_square_p(counts, second_probs) > 1e-3


def test_tree_rule_emits_the_target_distribution():
    """The tree rule alone, many draws: the first token follows the root's p whichever of three children hold it, and
    the second, after the first child, follows that child's p."""
    vocab, draws = 6, 20000
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, vocab, generator=gen) * 1.5, -1)
    # root → children tokens 2, 0, 5 (nodes 1-3); node 1 (token 2) → child token 4 (node 4)
    tokens, parents, depths = torch.tensor([0, 2, 0, 5, 4]), torch.tensor([-1, 0, 0, 0, 1]), torch.tensor([0, 1, 1, 1, 2])
    probs = torch.cat([probs, probs[1:2]])  # node 4's distribution: any distribution will do
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # after the first token was 2 (node 1 accepted)
    for _ in range(draws):
        accepted, bonus, path = tree_sampled(tokens, parents, depths, probs, torch.rand(5, generator=gen), levels=2)
        path = path[1 : int(accepted) + 1].tolist()
        emitted = tokens[path].tolist() + [int(bonus)]
        first[emitted[0]] += 1
        if path[:1] == [1]:
            second[emitted[1]] += 1
    assert chi_square_p(first, probs[0]) > 1e-3
    assert chi_square_p(second, probs[1]) > 1e-3
    # the test has power: a wrong rule (always accept the first child) is rejected outright
    assert chi_square_p(torch.tensor([0, 0, draws, 0, 0, 0], dtype=torch.float), probs[0]) < 1e-6


def test_draw_follows_unnormalised_weights_and_never_picks_a_zero():
    gen = torch.Generator().manual_seed(1)
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5])  # sums to 7: draw renormalises
    tokens = draw(weights.expand(14000, -1), torch.rand(14000, generator=gen))
    counts = torch.bincount(tokens, minlength=len(weights)).float()
    assert counts[weights == 0].sum() == 0
    assert chi_square_p(counts, weights / weights.sum()) > 1e-3
    # the edges: a uniform of 0 draws the first token of mass, one just below 1 the last
    assert draw(weights, torch.tensor(0.0)).item() == 1 and draw(weights, torch.tensor(1 - 1e-7)).item() == 6


def test_draw_stays_out_of_compiled_rounds_and_draws_as_eagerly():
    """Inductor's Triton scan fails on draw's float64 cumulative sum over a vocabulary (a block drafter's drawn chain on
    the GPU fell back to eager): a compiled round runs draw eagerly — a graph break — and draws the same tokens."""
    gen = torch.Generator().manual_seed(3)
    probs, uniforms = torch.rand(15, 300, generator=gen), torch.rand(15, generator=gen)

    def round_end(p, u):
        return draw(torch.softmax(p, -1), u) + 1

    explained = torch._dynamo.explain(round_end)(probs, uniforms)
    assert explained.graph_break_count >= 1
    assert not any("cumsum" in str(node.target) for graph in explained.graphs for node in graph.graph.nodes)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(round_end, dynamic=False)(probs, uniforms), round_end(probs, uniforms))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.7)), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.8)), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.81)), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_sampling_follows_the_target_end_to_end(mode, monkeypatch):
    """The token decided by the acceptance walk vs the target's exact distribution, through the engine.

    Drafts are the target's two likeliest tokens, so they are often accepted and often rejected.
    """
    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))  # flat model: sharpen
    likely = second_probs.topk(2).indices.tolist()
    if mode == "chain":
        speculation = Chain(3)

        def fixed(self):  # the same three drafts whatever the context: verification must stay lossless anyway
            return Draft(torch.cat([self.state.root, torch.tensor([likely[0], 0, 0])]), self.state.target_length + self.steps)
    else:
        speculation = TREE

        def fixed(self):
            depths = torch.tensor([0, 1, 1])
            return Draft(torch.cat([self.state.root, torch.tensor([likely[1], likely[0]])]), self.state.target_length + depths,
                         torch.tensor([-1, 0, 0]), depths)
    monkeypatch.setattr(GreedyChain if mode == "chain" else TopKTree, "propose",
                        lambda proposer, decoding_round, uniforms: (fixed(decoding_round), None))
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, drafter, speculation, Sampling(temperature=0.05, seed=seed,
                                                                                draft_sampling="greedy")),
        first, second_probs, seeds=800, least=200)


@pytest.mark.parametrize("mode,verification", [("chain", "standard"), ("chain", "block"), ("tree", "standard")])
def test_drawn_drafts_through_the_engine_follow_the_target(mode, verification, monkeypatch):
    """Drafts drawn from the drafter's distribution (``draft_sampling="probabilistic"``), through the engine: the
    token decided after the first round's drafts follows the target's distribution (χ²). The drafter's distribution is
    pinned to 0.6 / 0.4 on the two tokens the target likes best among those the draft vocabulary holds, so the first
    draft is accepted and rejected often, by each rule. A tree draws its children without replacement in its static
    shape (eyas.engine.drawn_tree): the root's second child is the other of the two."""
    from eyas.families.eagle3.runner import DraftRunner

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=64)
    prompt = prompt_of(11, length=6)
    first, second_probs = first_two_distributions(model, prompt, Sampling(temperature=0.05))
    vocab = drafter.vocabulary()
    best = second_probs[vocab].topk(2).indices  # draft-vocabulary entries
    wanted = torch.full((len(vocab),), 1e-9)
    wanted[best] = torch.tensor([0.6, 0.4])
    monkeypatch.setattr(DraftRunner, "logits", lambda self, prenorm: (0.05 * wanted.log()).expand(prenorm.shape[1], -1))
    assert_second_token_follows(
        lambda seed: generate(target, prompt, 2, drafter, Chain(3) if mode == "chain" else TREE, Sampling(
            temperature=0.05, seed=seed, draft_sampling="probabilistic", verification=verification)),
        first, second_probs, seeds=800, least=200)


def test_block_verification_is_refused_for_trees_in_one_line():
    """Asked for by name, block verification is refused for trees; the default (auto) draws a chain's drafts and keeps
    a tree's children from T = 0.85 (its top-k below); greedy decoding has no rule."""
    from eyas.errors import EyasError

    auto = Sampling(temperature=1.0)
    assert (auto.resolved("chain").draft_sampling, auto.resolved("tree").draft_sampling) == ("probabilistic",) * 2
    assert Sampling(temperature=0.7).resolved("tree").draft_sampling == "greedy"
    assert Sampling(draft_sampling="probabilistic", verification="block").resolved("chain").rule_label == ""
    auto.check_mode("tree")
    Sampling(temperature=1.0, draft_sampling="probabilistic").check_mode("tree")

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=64)
    with pytest.raises(EyasError, match="chain modes"):
        generate(target, prompt_of(1, length=6), 4, drafter, TREE, Sampling(temperature=1.0, verification="block"))
    with pytest.raises(EyasError, match="one of auto, greedy, probabilistic"):
        Sampling(temperature=1.0, draft_sampling="sampled")


def test_drawn_tree_shape_fits_its_dynamic_twin():
    """A drawn tree's static shape has the dynamic tree's node count and bounds (depth, children a node, nodes expanded
    a level), its parents precede their children, and each node's children are ranks 0 … m − 1 in node order."""
    from eyas.engine.drawn_tree import DrawnTreeShape
    from eyas.engine.modes import tree_size

    for top_k, depth, total in [(10, 7, 60), (4, 3, 10), (2, 6, 30), (1, 4, 4), (8, 8, 64)]:
        shape = DrawnTreeShape.best(top_k, depth, total)
        assert shape.nodes == tree_size(top_k, depth, total)
        assert shape.depth <= depth and all(0 <= p < c for c, p in enumerate(shape.parents) if c)
        assert all(len(hosts) <= top_k for hosts in shape.hosts)
        for node in range(shape.nodes + 1):
            children = shape.children(node)
            assert [shape.ranks[c] for c in children] == list(range(len(children))) and len(children) <= top_k
            assert all(shape.depths[c] == shape.depths[node] + 1 for c in children)
    assert DrawnTreeShape.best(1, 4, 4).parents == (-1, 0, 1, 2, 3)  # one child a node: a chain


@pytest.mark.parametrize("tree", [TREE, Tree(top_k=3, depth=5, total=20)], ids=["tree:10,3,4", "tree:20,5,3"])
def test_drawn_tree_rounds_match_drawing_by_hand(tree):
    """The engine's drawn tree, checked node by node: each host's distribution is the drafter's after the host's path,
    as a chain forced along that path computes it, and its children are the first ranks of Gumbel draws from it at its
    row of uniforms."""
    from eyas.engine.drafting import draw_chain
    from eyas.engine.drawn_tree import draw_without_replacement

    model = ARCHITECTURES["llama"][0]()
    target, drafter = runners(model, capacity=64)
    prompt = prompt_of(5, length=6)
    sampling = Sampling(temperature=1.0, draft_sampling="probabilistic")
    logits, aux = target.prefill(prompt)
    decoding_round, _ = round_for(target, drafter, tree)
    root = int(logits.argmax())
    decoding_round.begin(prompt, aux, root)
    proposer = decoding_round.decoder(sampling.resolved("tree")).proposer  # the drawn tree's
    shape = proposer.shape
    uniforms = torch.rand(proposer.uniforms, generator=torch.Generator().manual_seed(7))
    draft, draft_probs = proposer.propose(decoding_round, uniforms)
    assert draft.parents.tolist() == list(shape.parents) and draft.depths.tolist() == list(shape.depths)
    assert draft.positions.tolist() == [len(prompt[0]) + d for d in shape.depths]

    def chained(path: list[int]) -> torch.Tensor:  # the drafter's distribution after the root and ``path``
        decoding_round.begin(prompt, aux, root)
        state, width, forced, rows = decoding_round.state, decoding_round.width, iter(path + [0]), []

        def pick(logits):
            rows.append(target_probs(logits, sampling))
            return torch.tensor([next(forced)]), rows[-1]

        draw_chain(drafter, decoding_round.aux, state.emitted.view(1, width), state.positions.view(1, width),
                   state.drafter_length, state.valid, len(path) + 1, pick)
        return rows[-1]

    rows = uniforms.view(shape.draws, -1)
    hosts = [h for level in shape.hosts for h in level]
    vocab = drafter.vocabulary()
    assert proposer.levels.hosts.tolist() == hosts
    for row, host in enumerate(hosts):
        path, node = [], host
        while node > 0:
            path.insert(0, int(draft.tokens[node]))
            node = shape.parents[node]
        q = draft_probs[row][vocab]
        assert torch.allclose(q, chained(path), atol=1e-5), f"host {host} (path {path})"
        children = shape.children(host)
        drawn = draw_without_replacement(q.view(1, -1), rows[row].view(1, -1), len(children))[0]
        assert draft.tokens[children].tolist() == vocab[drawn].tolist()
    assert len(draft_probs) == len(hosts)
