"""Pieces every family file shares: config parsing, the cached-attention write path, and the
checks and stage plumbing of tensor and pipeline parallelism (docs/distributed.md)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..attention import attention_any, store_and_attend
from ..cache import KVCacheManager, make_cache
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
    return store_and_attend(cache, layer, queries, keys, values, position, scale=scale, sinks=sinks)


def written_attention(cache: KVCacheManager, layer: int, queries: mx.array, *, scale: float) -> mx.array:
    """Attention of M query rows over a layer whose K/V for them are already written
    (a layer reading another's KV, after the owner's write this forward pass)."""
    if isinstance(cache, SequenceBatch):
        return cache.each(lambda c, q: written_attention(c, layer, q, scale=scale), queries)
    position = cache.layer_offset(layer) - queries.shape[2]
    return attention_any(cache, layer, queries, position, scale=scale)


def cache_for_call(model, cache: KVCacheManager | None, inputs: mx.array) -> KVCacheManager:
    """The cache a forward pass uses: the caller's, or a fresh uncompressed one sized for this
    call, its rows in the model's dtype."""
    if cache is not None:
        return cache
    B, L = inputs.shape[:2]
    return make_cache(model, "fp16", batch_size=B, max_rows=L, step=L)


def shard_group(model, family: str, group: mx.distributed.Group | None, **sizes: int) -> mx.distributed.Group:
    """The group a family's `shard` splits over, after checking that it can.

    Tensor parallelism gives each rank whole heads and whole MLP columns, so every size
    in `sizes` (heads, KV heads, intermediate size) must divide by the group size; a model
    is sharded once. Raises ValueError naming the family and the sizes that do not divide.
    """
    group = group or mx.distributed.init()
    N = group.size()
    if getattr(model, "tensor_group", None) is not None:
        raise ValueError(f"{family}: the model is already sharded over {model.tensor_group.size()} ranks")
    bad = [f"{name}={n}" for name, n in sizes.items() if n % N]
    if bad:
        raise ValueError(
            f"{family}: cannot shard over {N} ranks: {', '.join(bad)} not divisible by {N} "
            "(each rank holds whole heads and whole MLP columns)"
        )
    model.tensor_group = group
    return group


def shard_attention_projections(attn, group: mx.distributed.Group) -> None:
    """Q/K/V keep 1/N of their output columns (this rank's heads); o_proj all-sums the partial
    outputs. The caller divides the module's head counts, whose names differ per family."""
    from mlx.nn.layers.distributed import shard_linear

    attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
    attn.k_proj = shard_linear(attn.k_proj, "all-to-sharded", group=group)
    attn.v_proj = shard_linear(attn.v_proj, "all-to-sharded", group=group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)


def shard_blocks(layers, group: mx.distributed.Group) -> None:
    """The standard tensor-parallel split of every block this rank holds (mlx-lm's): Q/K/V and
    the MLP's gate/up keep 1/N of their output columns, o_proj and down_proj all-sum the
    partial outputs, and the attention module's head counts drop to this rank's."""
    from mlx.nn.layers.distributed import shard_linear

    N = group.size()
    for layer in layers:
        if layer is None:  # another pipeline stage's layer
            continue
        attn, mlp = layer.self_attn, layer.mlp
        shard_attention_projections(attn, group)
        attn.n_heads //= N
        attn.n_kv_heads //= N
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)


def parallel_group(model) -> mx.distributed.Group | None:
    """The group `model` is split over by `shard` or `pipeline`, or None for a whole model."""
    for _, m in model.named_modules():
        group = getattr(m, "tensor_group", None) or getattr(m, "pipeline_group", None)
        if group is not None:
            return group
    return None


def not_shardable(family: str, why: str) -> ValueError:
    """The error of a family whose `shard` or `pipeline` is not implemented, naming it and why."""
    return ValueError(f"{family}: tensor and pipeline parallelism are not implemented for this family: {why}")


class PipelineMixin:
    """Pipeline parallelism over `self.layers`, laid out as mlx-lm's (mlx_lm/models/pipeline.py).

    `pipeline(group)` keeps a contiguous run of layers on each rank: the highest rank runs the
    first layers and rank 0 the last ones. The others become None, so their weights are
    never loaded and the rank's cache (built from `kv_layer_specs`) holds its layers only.
    A forward pass receives the activations from rank + 1 (`stage_input`), runs its layers and
    sends to rank - 1 (`stage_output`); an all_gather then gives every rank rank 0's output,
    which is the model's, so every rank computes the same logits.
    """

    def __init__(self):
        super().__init__()
        self.pipeline_group = None
        self.start_idx = 0
        self.end_idx = None

    @property
    def pipeline_layers(self) -> list:
        return self.layers[self.start_idx : self.end_idx]

    def pipeline(self, group: mx.distributed.Group, split: Sequence[int] | None = None) -> None:
        """Keep this rank's layers: `split[r]` of them on rank r (default: even, low ranks get the extra)."""
        if self.pipeline_group is not None:
            raise ValueError(f"the model is already split over {self.pipeline_group.size()} pipeline stages")
        n, N, r = len(self.layers), group.size(), group.rank()
        if split is None:
            if n < N:
                raise ValueError(f"cannot split {n} layers over {N} pipeline stages")
            base, extra = divmod(n, N)
            split = [base + (1 if i < extra else 0) for i in range(N)]
        if len(split) != N or any(s <= 0 for s in split) or sum(split) != n:
            raise ValueError(f"split {list(split)} must give each of {N} ranks some of the {n} layers")
        self.start_idx = sum(split[r + 1 :])
        self.end_idx = self.start_idx + split[r]
        self.layers = [l if self.start_idx <= i < self.end_idx else None for i, l in enumerate(self.layers)]
        self.pipeline_group = group

    def stage_input(self, h: mx.array) -> mx.array:
        """The activations this stage starts from: received from rank + 1, unless it runs the first layers."""
        g = self.pipeline_group
        if g is None or g.rank() == g.size() - 1:
            return h
        return mx.distributed.recv_like(h, g.rank() + 1, group=g)

    def stage_output(self, h: mx.array, cache: KVCacheManager) -> mx.array:
        """The model's activations after the last layer, on every rank: this stage's output is
        sent on to rank - 1, and the all_gather brings rank 0's (the last layers') to all."""
        g = self.pipeline_group
        if g is None or g.size() == 1:
            return h
        if g.rank() != 0:
            h = mx.distributed.send(h, g.rank() - 1, group=g)
            cache.depends_on(h)  # a prefill chunk evaluates only the cache; the next stage waits for h
        return mx.distributed.all_gather(h, group=g)[: h.shape[0]]
