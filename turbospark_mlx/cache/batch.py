"""Several sequences in one forward pass, each on its own single-sequence cache.

A decode step is bound by reading the weights; B sequences stepping together read them
once. `SequenceBatch` lets a model run a (B, M) input where sequence b writes to and
attends over its own `KVCacheManager` at its own position: the projections and the MLP
see the whole batch, attention is split per sequence. Sequences of any length, joining
and leaving at any step, need no padding, and each gets what running it alone gives (bit
for bit on a BLAS that rounds a row the same whatever the row count, as MLX's own does).
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from .manager import KVCacheManager


class SequenceBatch:
    """B single-sequence caches of one model, used as the `cache` of one forward pass.

    Families call `layer_offset` (a (B,) array: RoPE takes per-sequence offsets) and
    `models.base.cached_attention`, which routes each sequence's rows to its cache.
    """

    def __init__(self, caches: Sequence[KVCacheManager]):
        self.caches = list(caches)
        if not self.caches:
            raise ValueError("a SequenceBatch needs at least one cache")
        specs = self.caches[0].specs
        for i, c in enumerate(self.caches):
            if c.batch_size != 1:
                raise ValueError(f"cache {i} holds {c.batch_size} sequences; a SequenceBatch takes one per cache")
            if c.specs != specs:
                raise ValueError(f"cache {i} is laid out for another model than cache 0")

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    def layer_offset(self, layer: int) -> mx.array:
        """Each sequence's committed positions in `layer`, shape (B,)."""
        return mx.array([c.layer_offset(layer) for c in self.caches])

    def each(self, fn: Callable[..., mx.array], *arrays: mx.array) -> mx.array:
        """fn(cache_b, *(a[b:b+1] for a in arrays)) for every sequence, concatenated on axis 0."""
        outs = [fn(c, *(a[b : b + 1] for a in arrays)) for b, c in enumerate(self.caches)]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
