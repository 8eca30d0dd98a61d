"""Every sampling rule keeps the target's distribution: chains and trees, T > 0, top-p < 1, drafts deterministic or
drawn from the drafter, token-by-token or block verification (eyas.engine.acceptance).

A toy world: over a vocabulary of 5, the target's next-token distribution and the drafter's are fixed random
functions of the whole prefix (the drafter's correlated with the target's, so drafts are accepted often and rejected
often). Decoding two tokens by speculative rounds, the pair emitted must follow p(t1)·p(t2 | t1) (a chi-square test
over the 25 pairs); the same test rejects a deliberately wrong rule, so it has the power to see one.
"""

import functools
import zlib

import pytest
import torch

from eyas.engine.acceptance import Sampling, block_verdict, sample, target_probs, walk_sampling
from test_engine_tree_sampling import chi_square_p

VOCAB, RUNS = 5, 12000


@functools.lru_cache(maxsize=None)
def _logits(who: str, prefix: tuple[int, ...]) -> torch.Tensor:
    seed = zlib.crc32(repr(("noise" if who == "noise" else "target", prefix)).encode())  # stable across runs
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5
    if who == "drafter":  # the target's logits, disturbed
        logits = logits + _logits("noise", prefix) * 0.8
    return logits


def dist(who: str, prefix: tuple[int, ...], sampling: Sampling) -> torch.Tensor:
    return target_probs(_logits(who, prefix), sampling).double()


def draft_chain(prefix, k, sampling, generator, drawn):
    """k drafts after ``prefix`` and the drafter's distribution each came from (drawn: sampled; else argmax)."""
    drafts, rows = [], []
    for _ in range(k):
        q = dist("drafter", prefix + tuple(drafts), sampling)
        drafts.append(sample(q, generator) if drawn else int(q.argmax()))
        rows.append(q)
    return drafts, torch.stack(rows)


def chain_round(prefix, sampling, generator, rule, drawn, k=3):
    drafts, q = draft_chain(prefix, k, sampling, generator, drawn)
    p = torch.stack([dist("target", prefix + tuple(drafts[:i]), sampling) for i in range(k + 1)])
    kept, bonus = rule(drafts, p, q if drawn else None, generator)
    return drafts[:kept] + [bonus]


def standard_chain(drafts, p, q, generator):
    tokens, parents = [-1, *drafts], list(range(-1, len(drafts)))
    path, bonus = walk_sampling(tokens, parents, p, generator, None if q is None else torch.cat([q, q[-1:]]))
    return len(path) - 1, bonus


def tree_round(prefix, sampling, generator, rule, drawn):
    """A fixed-shape tree: two children of the root (drawn without replacement from q, or q's two likeliest), one
    child under each."""
    q_root = dist("drafter", prefix, sampling)
    if drawn:
        first = sample(q_root, generator)
        rest = q_root.clone()
        rest[first] = 0.0
        pair = [first, sample(rest, generator)]
    else:
        pair = q_root.topk(2).indices.tolist()
    q_rows = [q_root]
    grand = []
    for token in pair:
        q = dist("drafter", prefix + (token,), sampling)
        grand.append(sample(q, generator) if drawn else int(q.argmax()))
        q_rows.append(q)
    tokens, parents = [-1, pair[0], pair[1], grand[0], grand[1]], [-1, 0, 0, 1, 2]
    node_prefix = [prefix, prefix + (pair[0],), prefix + (pair[1],), prefix + (pair[0], grand[0]),
                   prefix + (pair[1], grand[1])]
    p = torch.stack([dist("target", pre, sampling) for pre in node_prefix])
    q = torch.stack(q_rows + [q_rows[1], q_rows[2]])  # leaves: no children, any row
    path, bonus = rule(tokens, parents, p, generator, q if drawn else None)
    return [tokens[n] for n in path[1:]] + [bonus]


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
    verdict = standard_chain if rule == "standard" else block_verdict
    p_value, _ = pair_test(functools.partial(chain_round, rule=verdict, drawn=drawn), sampling)
    assert p_value > 1e-3


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top-p0.8"])
@pytest.mark.parametrize("drawn", [False, True], ids=["top-k-drafts", "drawn-without-replacement"])
def test_tree_rules_keep_the_target_distribution(drawn, sampling):
    p_value, _ = pair_test(functools.partial(tree_round, rule=walk_sampling, drawn=drawn), sampling)
    assert p_value > 1e-3


def test_block_verification_keeps_at_least_as_many_drafts():
    """Block verification is never worse than token-by-token on average (Sun et al.): here with drawn drafts."""
    sampling = Sampling(temperature=1.0)
    _, standard = pair_test(functools.partial(chain_round, rule=standard_chain, drawn=True), sampling, seed=5)
    _, block = pair_test(functools.partial(chain_round, rule=block_verdict, drawn=True), sampling, seed=5)
    assert block >= standard - 0.02


def test_wrong_rules_fail_the_same_test():
    """The test has power: argmax drafts judged as if drawn from q (min(1, p/q) for a token nobody drew), a residual
    that forgets to subtract q, and block verification without its residual mass — each is caught. (Drawn drafts
    judged as one-hot are not wrong: the draft is then a known token, and that rule holds for any draft; it only
    accepts less often, Σ p·q against Σ min(p, q).)"""
    sampling = Sampling(temperature=1.0)

    def argmax_judged_as_drawn(prefix, sampling, generator):
        drafts, q = draft_chain(prefix, 3, sampling, generator, drawn=False)
        p = torch.stack([dist("target", prefix + tuple(drafts[:i]), sampling) for i in range(4)])
        kept, bonus = standard_chain(drafts, p, q, generator)
        return drafts[:kept] + [bonus]

    def residual_is_p(drafts, p, q, generator):
        for i, token in enumerate(drafts):
            if float(torch.rand((), generator=generator)) * float(q[i, token]) < float(p[i, token]):
                continue
            return i, sample(p[i], generator)
        return len(drafts), sample(p[-1], generator)

    def block_without_mass(drafts, p, q, generator):
        ratio, kept = 1.0, 0
        for i, token in enumerate(drafts):
            ratio = min(1.0, ratio * float(p[i, token]) / float(q[i, token]))
            if float(torch.rand((), generator=generator)) < ratio:
                kept = i + 1
        return kept, sample(p[kept] if kept == len(drafts) else (ratio * p[kept] - q[kept]).clamp(min=0), generator)

    rounds = {"argmax_judged_as_drawn": argmax_judged_as_drawn,
              "residual_is_p": functools.partial(chain_round, rule=residual_is_p, drawn=True),
              "block_without_mass": functools.partial(chain_round, rule=block_without_mass, drawn=True)}
    for name, round_fn in rounds.items():
        p_value, _ = pair_test(round_fn, sampling)
        assert p_value < 1e-6, name


def test_drawn_drafts_are_accepted_more_often_than_argmax_ones():
    """Why the rule exists: at T = 1 a flat target often refuses the drafter's argmax, while a draft drawn from a q
    close to p is kept with probability Σ min(p, q)."""
    sampling = Sampling(temperature=1.0)
    _, argmax = pair_test(functools.partial(chain_round, rule=standard_chain, drawn=False), sampling, seed=5)
    _, drawn = pair_test(functools.partial(chain_round, rule=standard_chain, drawn=True), sampling, seed=5)
    assert drawn > argmax + 0.05
