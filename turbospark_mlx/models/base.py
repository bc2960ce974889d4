"""Pieces every family file shares: config parsing and the cached-attention write path."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx

from ..attention import attention_any
from ..cache import KVCacheManager, commit_kv, kv_write_target
from ..cache.batch import SequenceBatch


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        """Build from an HF config dict, ignoring keys this family does not use.

        A field without a default that the config lacks is a ValueError naming it
        (a silent default would build a model of the wrong shape).
        """
        fields = inspect.signature(cls).parameters
        missing = [
            name for name, p in fields.items() if p.default is inspect.Parameter.empty and name not in params
        ]
        if missing:
            raise ValueError(
                f"{cls.__module__}.{cls.__name__}: config lacks required field(s) {', '.join(missing)}"
            )
        return cls(**{k: v for k, v in params.items() if k in fields})


def cached_attention(
    cache: KVCacheManager,
    layer: int,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    position: int | mx.array,
    *,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """The write path of one attention block, for M rows at `position`.

    keys/values are finished (k-norm and RoPE applied): they go to the slot or
    the staging row, are committed (quantized on a TurboQuant layer), and the
    queries attend over the cache. Shapes (B, H, M, D); returns (B, Hq, M, D).
    A `SequenceBatch` cache routes each sequence to its own cache and position.
    """
    if isinstance(cache, SequenceBatch):
        return cache.each(
            lambda c, q, k, v: cached_attention(c, layer, q, k, v, c.layer_offset(layer), scale=scale, sinks=sinks),
            queries, keys, values,
        )
    kv_write_target(cache, "k", layer, position).write(keys)
    kv_write_target(cache, "v", layer, position).write(values)
    commit_kv(cache, layer, position, keys.shape[2])
    return attention_any(cache, layer, queries, position, scale=scale, sinks=sinks)


def written_attention(cache: KVCacheManager, layer: int, queries: mx.array, *, scale: float) -> mx.array:
    """Attention of M query rows over a layer whose K/V for them are already written
    (a layer reading another's KV, after the owner's write this forward pass)."""
    if isinstance(cache, SequenceBatch):
        return cache.each(lambda c, q: written_attention(c, layer, q, scale=scale), queries)
    position = cache.layer_offset(layer) - queries.shape[2]
    return attention_any(cache, layer, queries, position, scale=scale)


def cache_for_call(model, cache: KVCacheManager | None, inputs: mx.array) -> KVCacheManager:
    """The cache a forward pass uses: the caller's, or a fresh FP16 one sized for this call."""
    if cache is not None:
        return cache
    B, L = inputs.shape[:2]
    return KVCacheManager(model.kv_layer_specs(), "fp16", batch_size=B, max_rows=L, step=L)
