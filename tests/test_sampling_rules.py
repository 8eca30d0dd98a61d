"""Every sampling rule keeps the target's distribution: chains and trees, T > 0, top-p < 1, drafts deterministic or
drawn from the drafter (chains), token-by-token or block verification (eyas.engine.acceptance: the rules the engine
runs on the device, here on the CPU with uniforms from a seeded generator).

A toy world: over a vocabulary of 5, the target's next-token distribution and the drafter's are fixed random
functions of the whole prefix (the drafter's correlated with the target's, so drafts are accepted often and rejected
often). Decoding two tokens by speculative rounds, the pair emitted must follow p(t1)·p(t2 | t1) (a chi-square test
over the 25 pairs); the same test rejects a deliberately wrong rule, so it has the power to see one.
"""

import functools
import zlib

import pytest
import torch

from eyas.engine.acceptance import Sampling, block_sampled, chain_sampled, draw, target_probs, tree_drawn, tree_sampled
from eyas.engine.drawn_tree import draw_without_replacement
from test_engine_tree_sampling import chi_square_p

VOCAB, RUNS = 5, 12000


@functools.lru_cache(maxsize=None)
def _logits(who: str, prefix: tuple[int, ...]) -> torch.Tensor:
    seed = zlib.crc32(repr(("noise" if who == "noise" else "target", prefix)).encode())  # stable across runs
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5
    if who == "drafter":  # the target's logits, disturbed
        logits = logits + _logits("noise", prefix) * 0.8
    return logits


@functools.lru_cache(maxsize=None)
def _dist(who: str, prefix: tuple[int, ...], sampling: Sampling) -> torch.Tensor:
    return target_probs(_logits(who, prefix), sampling).double()


def dist(who: str, prefix: tuple[int, ...], sampling: Sampling) -> torch.Tensor:
    """The fixed distribution of ``who`` after ``prefix`` (computed once: the tests ask for the same ones thousands of
    times), a copy the caller may change."""
    return _dist(who, prefix, sampling).clone()


def uniform(generator, n=1):
    return torch.rand(n, generator=generator, dtype=torch.float64)


def draft_chain(prefix, k, sampling, generator, drawn):
    """k drafts after ``prefix`` and the drafter's distribution each came from (drawn: sampled; else argmax)."""
    drafts, rows = [], []
    for _ in range(k):
        q = dist("drafter", prefix + tuple(drafts), sampling)
        drafts.append(int(draw(q, uniform(generator)[0])) if drawn else int(q.argmax()))
        rows.append(q)
    return drafts, torch.stack(rows)


def chain_round(prefix, sampling, generator, rule, drawn, k=3):
    drafts, q = draft_chain(prefix, k, sampling, generator, drawn)
    p = torch.stack([dist("target", prefix + tuple(drafts[:i]), sampling) for i in range(k + 1)])
    kept, bonus = rule(torch.tensor(drafts), p, q if drawn else None, uniform(generator, k + 1))
    return drafts[: int(kept)] + [int(bonus)]


def tree_round(prefix, sampling, generator, rule=tree_sampled):
    """A fixed-shape tree of the drafter's likeliest tokens: the root's two best children, the best child under each."""
    pair = dist("drafter", prefix, sampling).topk(2).indices.tolist()
    grand = [int(dist("drafter", prefix + (token,), sampling).argmax()) for token in pair]
    tokens, parents, depths = [-1, pair[0], pair[1], grand[0], grand[1]], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    node_prefix = [prefix, prefix + (pair[0],), prefix + (pair[1],), prefix + (pair[0], grand[0]),
                   prefix + (pair[1], grand[1])]
    p = torch.stack([dist("target", pre, sampling) for pre in node_prefix])
    tokens[0] = 0  # the root's token is never read
    accepted, bonus, path = rule(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), p,
                                 uniform(generator, 5), levels=2)
    return [tokens[n] for n in path[1 : int(accepted) + 1].tolist()] + [int(bonus)]


def two_tokens(round_fn, sampling, generator) -> tuple[int, int]:
    emitted = []
    while len(emitted) < 2:
        emitted += round_fn(tuple(emitted), sampling, generator)
    return emitted[0], emitted[1]


def pair_test(round_fn, sampling, seed=0) -> tuple[float, float]:
    """(p-value of the emitted pairs against the target's joint, mean tokens per round)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    emitted_per_round = []

    def counting(prefix, sampling, generator):
        out = round_fn(prefix, sampling, generator)
        emitted_per_round.append(len(out))
        return out

    for _ in range(RUNS):
        first, second = two_tokens(counting, sampling, generator)
        counts[first * VOCAB + second] += 1
    p1 = dist("target", (), sampling)
    joint = torch.cat([p1[a] * dist("target", (a,), sampling) for a in range(VOCAB)])
    return chi_square_p(counts, joint), sum(emitted_per_round) / len(emitted_per_round)


SAMPLINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top-p0.8"])
@pytest.mark.parametrize("drawn", [False, True], ids=["argmax-drafts", "drawn-drafts"])
@pytest.mark.parametrize("rule", ["standard", "block"])
def test_chain_rules_keep_the_target_distribution(rule, drawn, sampling):
    verdict = chain_sampled if rule == "standard" else block_sampled
    p_value, _ = pair_test(functools.partial(chain_round, rule=verdict, drawn=drawn), sampling)
    assert p_value > 1e-3


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top-p0.8"])
def test_tree_rule_keeps_the_target_distribution(sampling):
    p_value, _ = pair_test(tree_round, sampling)
    assert p_value > 1e-3


def test_block_verification_keeps_at_least_as_many_drafts():
    """Block verification is never worse than token-by-token on average (Sun et al.): here with drawn drafts."""
    sampling = Sampling(temperature=1.0)
    _, standard = pair_test(functools.partial(chain_round, rule=chain_sampled, drawn=True), sampling, seed=5)
    _, block = pair_test(functools.partial(chain_round, rule=block_sampled, drawn=True), sampling, seed=5)
    assert block >= standard - 0.02


def test_wrong_rules_fail_the_same_test():
    """The test has power: argmax drafts judged as if drawn from q (min(1, p/q) for a token nobody drew), a residual
    that forgets to subtract q, block verification without its residual mass, and a tree whose later siblings are
    judged with their plain p — each is caught. (Drawn drafts judged as one-hot are not wrong: the draft is then a
    known token, and that rule holds for any draft; it only accepts less often, Σ p·q against Σ min(p, q).)"""
    sampling = Sampling(temperature=1.0)

    def argmax_judged_as_drawn(prefix, sampling, generator):
        drafts, q = draft_chain(prefix, 3, sampling, generator, drawn=False)
        p = torch.stack([dist("target", prefix + tuple(drafts[:i]), sampling) for i in range(4)])
        kept, bonus = chain_sampled(torch.tensor(drafts), p, q, uniform(generator, 4))
        return drafts[: int(kept)] + [int(bonus)]

    def residual_is_p(drafts, p, q, uniforms):
        kept, _ = chain_sampled(drafts, p, q, uniforms)
        return kept, draw(p[int(kept)], uniforms[-1])

    def block_without_mass(drafts, p, q, uniforms):
        ratio, kept = 1.0, 0
        for i, token in enumerate(drafts.tolist()):
            ratio = min(1.0, ratio * float(p[i, token]) / float(q[i, token]))
            if float(uniforms[i]) < ratio:
                kept = i + 1
        rest = p[kept] if kept == len(drafts) else (ratio * p[kept] - q[kept]).clamp(min=0)
        return kept, draw(rest, uniforms[-1])

    def siblings_judged_alone(tokens, parents, depths, p, uniforms, levels):  # a later child: p(c), not p(c) / (1 − Σ)
        tokens, parents, node, path = tokens.tolist(), parents.tolist(), 0, [0]
        while True:
            children = [c for c, parent in enumerate(parents) if parent == node]
            winner = next((c for c in children if float(uniforms[c]) < float(p[node, tokens[c]])), None)
            if winner is None:
                rest = p[node].clone()
                rest[[tokens[c] for c in children]] = 0.0
                return len(path) - 1, draw(rest, uniforms[0]), torch.tensor(path + [0] * (levels + 1 - len(path)))
            node = winner
            path.append(node)

    rounds = {"argmax_judged_as_drawn": argmax_judged_as_drawn,
              "residual_is_p": functools.partial(chain_round, rule=residual_is_p, drawn=True),
              "block_without_mass": functools.partial(chain_round, rule=block_without_mass, drawn=True),
              "siblings_judged_alone": functools.partial(tree_round, rule=siblings_judged_alone)}
    for name, round_fn in rounds.items():
        p_value, _ = pair_test(round_fn, sampling)
        assert p_value < 1e-6, name


def test_drawn_drafts_are_accepted_more_often_than_argmax_ones():
    """Why the rule exists: at T = 1 a flat target often refuses the drafter's argmax, while a draft drawn from a q
    close to p is kept with probability Σ min(p, q)."""
    sampling = Sampling(temperature=1.0)
    _, argmax = pair_test(functools.partial(chain_round, rule=chain_sampled, drawn=False), sampling, seed=5)
    _, drawn = pair_test(functools.partial(chain_round, rule=chain_sampled, drawn=True), sampling, seed=5)
    assert drawn > argmax + 0.05


# A drawn tree: the root draws three children without replacement, its first two children draw one child each.
DRAWN_SHAPE = {"parents": [-1, 0, 0, 0, 1, 2], "depths": [0, 1, 1, 1, 2, 2], "hosts": [0, 1, 2], "children": [3, 1, 1]}


def drawn_tree_round(prefix, sampling, generator, rule=tree_drawn, pick=None):
    """One round of the drawn tree above: children by :func:`draw_without_replacement` (``pick``: another way of
    choosing them, from q and the generator), judged by ``rule``."""
    pick = pick or (lambda q, k: draw_without_replacement(q.view(1, -1), uniform(generator, VOCAB).view(1, -1), k)[0])
    parents, depths = DRAWN_SHAPE["parents"], DRAWN_SHAPE["depths"]
    tokens, node_prefix = [0] * 6, [prefix] * 6
    q_rows = torch.zeros(6, VOCAB, dtype=torch.float64)
    for host, count in zip(DRAWN_SHAPE["hosts"], DRAWN_SHAPE["children"], strict=True):
        q_rows[host] = dist("drafter", node_prefix[host], sampling)
        children = [c for c, p in enumerate(parents) if p == host]
        for child, token in zip(children, pick(q_rows[host], count).tolist(), strict=True):
            tokens[child], node_prefix[child] = token, node_prefix[host] + (token,)
    p = torch.stack([dist("target", pre, sampling) for pre in node_prefix])
    hosts = torch.tensor(DRAWN_SHAPE["hosts"])
    accepted, bonus, path = rule(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), p, hosts,
                                 q_rows[hosts], uniform(generator, 6), levels=2, siblings=3)
    return [tokens[n] for n in path[1 : int(accepted) + 1].tolist()] + [int(bonus)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top-p0.8"])
def test_drawn_tree_rule_keeps_the_target_distribution(sampling):
    """Children drawn without replacement, judged rank by rank against q without the earlier siblings (at top-p 0.8 the
    drafter's nucleus is often smaller than three tokens: children of no mass, never accepted)."""
    p_value, _ = pair_test(drawn_tree_round, sampling)
    assert p_value > 1e-3


def test_draws_without_replacement_follow_q_then_q_without_the_first():
    gen = torch.Generator().manual_seed(3)
    q = torch.tensor([0.0, 0.5, 0.2, 0.3])
    pairs = draw_without_replacement(q.expand(20000, -1), torch.rand(20000, 4, generator=gen), 2)
    first = torch.bincount(pairs[:, 0], minlength=4).double()
    assert first[0] == 0 and chi_square_p(first, q.double()) > 1e-3
    after_one = pairs[pairs[:, 0] == 1, 1]  # the second draw, after token 1 was drawn first
    expected = torch.tensor([0.0, 0.0, 0.4, 0.6], dtype=torch.float64)
    assert chi_square_p(torch.bincount(after_one, minlength=4).double(), expected) > 1e-3


def test_drawn_trees_are_accepted_more_often_than_top_k_ones():
    """Why drawn trees: at T = 1 drawn children judged by their rule keep more tokens a round than the top-k children of
    the same shape judged by the deterministic rule."""
    sampling = Sampling(temperature=1.0)

    def top_k_judged_as_fixed(tokens, parents, depths, p, hosts, q, uniforms, levels, siblings):
        return tree_sampled(tokens, parents, depths, p, uniforms, levels)

    _, drawn = pair_test(drawn_tree_round, sampling, seed=5)
    _, top_k = pair_test(functools.partial(drawn_tree_round, rule=top_k_judged_as_fixed,
                                           pick=lambda q, k: q.topk(k).indices), sampling, seed=5)
    assert drawn > top_k + 0.02


def test_wrong_drawn_tree_rules_fail_the_same_test():
    """The drawn-tree test has power: the root's children drawn, then ordered by q rather than as drawn (a dynamic tree's
    selection by score: the children no longer follow q, q without the first, …), and later siblings judged against q
    itself rather than q without the earlier ones — each is caught."""
    sampling = Sampling(temperature=1.0)

    def best_first(generator):
        def pick(q, k):
            drawn = draw_without_replacement(q.view(1, -1), uniform(generator, VOCAB).view(1, -1), 3)[0]
            return drawn[q[drawn].argsort(descending=True)] if k == 3 else drawn[:k]
        return pick

    def q_not_renormalised(tokens, parents, depths, p, hosts, q_hosts, uniforms, levels, siblings):
        tokens_l, parents_l, node, path = tokens.tolist(), parents.tolist(), 0, [0]
        q = torch.zeros_like(p).index_copy_(0, hosts, q_hosts)
        while True:
            residual = p[node].clone()
            winner = None
            for c in (c for c, parent in enumerate(parents_l) if parent == node):
                x = tokens_l[c]
                if float(q[node, x]) > 0 and float(uniforms[c]) * float(q[node, x]) < float(residual[x]):
                    winner = c
                    break
                residual = (residual - q[node]).clamp(min=0)
                residual = residual / residual.sum()
            if winner is None:
                return len(path) - 1, draw(residual, uniforms[0]), torch.tensor(path + [0] * (levels + 1 - len(path)))
            node = winner
            path.append(node)

    def selected(prefix, sampling, generator):
        return drawn_tree_round(prefix, sampling, generator, pick=best_first(generator))

    for name, round_fn in {"selected_by_q": selected,
                           "q_not_renormalised": functools.partial(drawn_tree_round, rule=q_not_renormalised)}.items():
        p_value, _ = pair_test(round_fn, sampling)
        assert p_value < 1e-6, name
