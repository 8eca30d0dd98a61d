"""The capture plan: which samples go in which batch, and which batches in which shard.

The plan is a pure function of the sample lengths and the options, computed before any work, so
every run — first, resumed after a kill, or one rank of many — agrees on it. That is what makes a
resumed capture bitwise identical to an uninterrupted one: a shard is always the same batches of
the same samples, padded the same way. Batches are length-sorted (longest first, ties by position)
to keep padding low, and packed to a token budget counted with padding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its index (name) and its batches, each a list of sample positions."""

    index: int
    batches: tuple[tuple[int, ...], ...]

    @property
    def samples(self) -> list[int]:
        """Sample positions in the order they are stored."""
        return [s for batch in self.batches for s in batch]


def plan_shards(
    lengths: list[int], token_budget: int, max_batch: int, shard_tokens: int
) -> list[ShardPlan]:
    """Pack samples into padded batches (≤ ``token_budget`` tokens with padding, ≤ ``max_batch`` rows),
    then consecutive batches into shards of about ``shard_tokens`` real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > token_budget or len(current) >= max_batch):
            batches.append(tuple(current))
            current = []
        current.append(i)
    if current:
        batches.append(tuple(current))

    shards: list[ShardPlan] = []
    group: list[tuple[int, ...]] = []
    tokens = 0
    for batch in batches:
        group.append(batch)
        tokens += sum(lengths[i] for i in batch)
        if tokens >= shard_tokens:
            shards.append(ShardPlan(len(shards), tuple(group)))
            group, tokens = [], 0
    if group:
        shards.append(ShardPlan(len(shards), tuple(group)))
    return shards
