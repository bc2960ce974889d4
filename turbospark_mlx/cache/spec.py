"""The shape of one attention layer's KV, as a model declares it (`kv_layer_specs()`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    """Shape of one attention layer's KV.

    Attributes:
        n_kv_heads: KV heads.
        head_dim: per-head dimension (K and V).
        window: sliding-window size; the layer is then an FP16 ring.
        shared_from: this layer attends over another (earlier) layer's KV
            and owns no storage (gemma4's KV-shared layers).
    """

    n_kv_heads: int
    head_dim: int
    window: int | None = None
    shared_from: int | None = None
