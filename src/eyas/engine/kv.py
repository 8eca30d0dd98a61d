"""A preallocated KV cache written at explicit slots, for any HF decoder.

transformers' own StaticCache decides where new keys go from an internal counter whose meaning
changed between releases (cache_position in 5.16/5.17, a cumulative length later). Speculative
decoding needs to say it outright: the verify forward writes k+1 speculative tokens after the
accepted ones, and the accepted ones are then kept (chain) or copied together (tree). So this cache
writes every forward's keys at ``slots`` set by the engine, returns the whole static buffer, and
leaves visibility entirely to the engine's 4D attention mask. It speaks the small part of the Cache
protocol decoder layers use (``update``), and nothing in it depends on a transformers version.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """Per decoder layer: keys/values [B, kv_heads, capacity, head_dim], allocated on first write."""

    def __init__(self, num_layers: int, capacity: int):  # noqa: D107 — Cache.__init__ differs across releases
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots: torch.Tensor | None = None  # where this forward's tokens go, set before each forward
        self.visible = capacity  # slots [0, visible) are returned to attention (the mask's width)
        self.layers = []  # Cache API: no HF layer objects; everything below is overridden
        self._stacked: torch.Tensor | None = None  # every layer's keys and values in one tensor, once consolidated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys[layer_idx] is None:
            batch, heads, _, _ = key_states.shape
            shape = (batch, heads, self.capacity)
            self.keys[layer_idx] = key_states.new_zeros(*shape, key_states.shape[-1])
            self.values[layer_idx] = value_states.new_zeros(*shape, value_states.shape[-1])
        self.keys[layer_idx].index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return self.keys[layer_idx][:, :, : self.visible], self.values[layer_idx][:, :, : self.visible]

    def put_rows(self, part: SlotCache, start: int, batch: int, offset: int = 0) -> None:
        """Copy every layer of ``part`` (fewer rows, fewer slots) into rows [start, start + its rows) and slots
        [offset, offset + part.capacity) of this cache of ``batch`` rows, allocating a layer on its first copy: a batch
        prefilled a few rows at a time."""
        for layer, (keys, values) in enumerate(zip(part.keys, part.values, strict=True)):
            if keys is None or values is None:
                continue
            if self.keys[layer] is None:
                self.keys[layer] = keys.new_zeros(batch, keys.shape[1], self.capacity, keys.shape[3])
                self.values[layer] = values.new_zeros(batch, values.shape[1], self.capacity, values.shape[3])
            end = start + keys.shape[0]
            self.keys[layer][start:end, :, offset: offset + part.capacity].copy_(keys)
            self.values[layer][start:end, :, offset: offset + part.capacity].copy_(values)

    def consolidate(self) -> None:
        """Once every layer is allocated: when all keys and values share one shape, keep them in one
        tensor (each layer's a view), so that a compaction is two kernels rather than four per layer."""
        buffers = [*self.keys, *self.values]
        if self._stacked is not None or any(b is None for b in buffers):
            return
        if len({(b.shape, b.dtype) for b in buffers}) != 1:
            return
        self._stacked = torch.stack(buffers)
        layers = len(self.keys)
        self.keys = [self._stacked[i] for i in range(layers)]
        self.values = [self._stacked[layers + i] for i in range(layers)]

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the entries at slots ``source`` to slots ``destination`` in every layer (tree compaction)."""
        if self._stacked is not None:
            self._stacked.index_copy_(3, destination, self._stacked.index_select(3, source))
            return
        for cache in (*self.keys, *self.values):
            if cache is not None:
                cache.index_copy_(2, destination, cache.index_select(2, source))

    # Parts of the Cache protocol a forward may touch besides update(); the engine always passes
    # position ids and a ready 4D mask, so these only need to be harmless.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)
