"""Attention over the KV cache: one fan-out point for every layer kind.

`attention_any` forks on `kv.layer_quant(layer)`:
  * TurboQuant layer: attention in the rotated space, straight from codes
    (arXiv 2504.19874 applied to attention):
        q' = Π_K q;  s_i = scale · ||k_i|| · Σ_j q'_j c_K[idx_ij]
        p = softmax(s, sink);  o' = Σ_i p_i ||v_i|| c_V[idx_v_i];  o = Π_Vᵀ o'
    No FP16 copy of the history is made.
  * FP16 layer (growing or ring): `mx.fast.scaled_dot_product_attention`
    with a position mask, which covers rings, `kv_start` and sinks.

Queries are M rows at positions [position, position + M) (M = 1 for decode;
more for chunked prefill and speculative verify); they see keys causally. A
compressed layer reads its new rows back from the packed codes, so a chunked
prefill computes exactly what token-by-token decode does.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import backend as _backend
from .cache import KvCacheManager
from .quant.turboquant import LayerQuant, dequantize_rotated_ref
from .tq_kernels import tq_decode_attention, tq_decode_unsupported


# Keys per block of the reference TurboQuant attention (bounds its float32 working set).
REF_KEY_BLOCK = 256


def attention_mask(
    key_positions: mx.array,
    query_positions: mx.array,
    kv_start: int | mx.array = 0,
    window: int | None = None,
) -> mx.array:
    """Which keys each query sees: (B or 1, 1, M, L) bool.

    A key at position p is visible to a query at position t when
    kv_start <= p <= t and, for a sliding window w, p > t - w. Unwritten
    slots carry position -1 and are never visible.
    """
    kp = key_positions[None, :]  # (1, L)
    qp = query_positions[:, None]  # (M, 1)
    start = mx.array(kv_start).reshape(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible = visible & (kp > qp - window)
    return visible[None, None] & (kp[None, None] >= start)


def fp16_attention_ref(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Dense attention in float32 with GQA, a boolean mask and sinks (the test oracle)."""
    B, Hq, M, D = queries.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    q = queries.astype(mx.float32).reshape(B, Hkv, G, M, D)
    k = keys.astype(mx.float32)[:, :, None]  # (B, Hkv, 1, L, D)
    v = values.astype(mx.float32)[:, :, None]
    scores = scale * (q @ k.swapaxes(-1, -2))  # (B, Hkv, G, M, L)
    out = _softmax_weighted(scores, v, mask, sinks, Hkv, G)
    return out.reshape(B, Hq, M, -1).astype(queries.dtype)


def tq_attention_ref(
    queries: mx.array,
    k_codes: mx.array,
    k_norms: mx.array,
    v_codes: mx.array,
    v_norms: mx.array,
    quant: LayerQuant,
    *,
    scale: float,
    mask: mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """TurboQuant attention from packed codes, computed in the rotated space.

    Args:
        queries: (B, Hq, M, D).
        k_codes, v_codes: (B, Hkv, L, words) uint32; k_norms, v_norms: (B, Hkv, L) float32.
        quant: the layer's K and V tables.
        mask: (B or 1, 1, M, L) bool, True where a key is visible.
        sinks: (Hq,) per-head sink logits, or None.
    Returns:
        (B, Hq, M, D) in the queries' dtype.
    """
    B, Hq, M, D = queries.shape
    Hkv, L = k_codes.shape[1], k_codes.shape[2]
    G = Hq // Hkv
    q_rot = quant.k.rotation.apply(queries).reshape(B, Hkv, G, M, D)  # q' = Π_K q, once per step
    # Online softmax over key blocks: only one block of keys is ever decoded to
    # float32, so the working memory of a step does not grow with the context.
    m = mx.full((B, Hkv, G, M, 1), -mx.inf)
    denom = mx.zeros((B, Hkv, G, M, 1))
    if sinks is not None:  # the sink is one more logit in the denominator, with no value
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, G, 1, 1), m.shape)
        denom = mx.ones(m.shape)
    acc = mx.zeros((B, Hkv, G, M, D))
    for s in range(0, L, REF_KEY_BLOCK):
        e = min(L, s + REF_KEY_BLOCK)
        k_rot = dequantize_rotated_ref(k_codes[:, :, s:e], k_norms[:, :, s:e], quant.k)[:, :, None]
        v_rot = dequantize_rotated_ref(v_codes[:, :, s:e], v_norms[:, :, s:e], quant.v)[:, :, None]
        scores = scale * (q_rot @ k_rot.swapaxes(-1, -2))  # (B, Hkv, G, M, block)
        if mask is not None:
            scores = mx.where(mask[:, :, None, :, s:e], scores, -mx.inf)
        m_new = mx.maximum(m, scores.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows that have seen no key yet
        alpha = mx.exp(m - m_safe)
        p = mx.exp(scores - m_safe)
        denom = denom * alpha + p.sum(axis=-1, keepdims=True)
        acc = acc * alpha + p @ v_rot
        m = m_new
    out = quant.v.rotation.invert(acc / denom)  # o = Π_Vᵀ o', once per step
    return out.reshape(B, Hq, M, D).astype(queries.dtype)


def _softmax_weighted(scores, values, mask, sinks, n_kv_heads: int, group: int) -> mx.array:
    """softmax over keys (and a per-head sink logit), then the weighted sum of values."""
    if mask is not None:
        scores = mx.where(mask[:, :, None], scores, -mx.inf)  # mask (B, 1, M, L) -> (B, 1, 1, M, L)
    if sinks is not None:
        sink = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, n_kv_heads, group, 1, 1), (*scores.shape[:-1], 1)
        )
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = mx.softmax(scores, axis=-1)
    return probs @ values


def attention_any(
    kv: KvCacheManager,
    layer: int,
    queries: mx.array,
    position: int | None = None,
    *,
    scale: float | None = None,
    sinks: mx.array | None = None,
    kv_start: int | mx.array = 0,
) -> mx.array:
    """Attention of M query rows over `layer`'s committed cache.

    Args:
        kv: the cache.
        layer: attention layer index (a KV-shared layer reads its owner).
        queries: (B, Hq, M, D); Hq a multiple of the layer's KV heads.
        position: position of the first query row; by default the last M
            committed positions.
        scale: score scale; default 1/sqrt(D).
        sinks: (Hq,) attention-sink logits (gpt-oss), or None.
        kv_start: keys before this position are ignored; an int or a (B,)
            int array (one start per sequence, e.g. left padding).
    Returns:
        (B, Hq, M, D) in the queries' dtype.
    """
    spec = kv.specs[kv.owner(layer)]
    _check_queries(kv, layer, queries, sinks)
    B, Hq, M, D = queries.shape
    committed = kv.layer_offset(layer)
    if position is None:
        position = committed - M
    if position < 0 or position + M > committed:
        raise ValueError(
            f"layer {layer}: queries at positions [{position}, {position + M}) but only {committed} are committed"
        )
    # Read the start(s) on the host: an mx reduction + .item() here would cost a GPU sync per layer.
    latest_start = kv_start if isinstance(kv_start, int) else int(np.asarray(kv_start).max())
    if latest_start > position:
        raise ValueError(f"layer {layer}: kv_start {kv_start} is past the first query position {position}")
    scale = D**-0.5 if scale is None else scale
    end = position + M
    arrays = kv.layer_arrays(layer)
    quant = kv.layer_quant(layer)
    q_pos = mx.arange(position, end)

    if quant is not None:
        backend = _backend.resolve(tq_decode_unsupported(quant, Hq // spec.n_kv_heads, D))
        if backend != "reference":
            return tq_decode_attention(
                queries,
                arrays["k_codes"],
                arrays["k_norms"],
                arrays["v_codes"],
                arrays["v_norms"],
                quant,
                scale=scale,
                position=position,
                kv_start=kv_start,
                sinks=sinks,
                backend=backend,
            )
        mask = attention_mask(mx.arange(end), q_pos, kv_start)
        return tq_attention_ref(
            queries,
            arrays["k_codes"][:, :, :end],
            arrays["k_norms"][:, :, :end],
            arrays["v_codes"][:, :, :end],
            arrays["v_norms"][:, :, :end],
            quant,
            scale=scale,
            mask=mask,
            sinks=sinks,
        )

    if kv.ring_capacity(layer) is None:
        if isinstance(kv_start, int):
            # Plain causal attention over [kv_start, end): MLX's fused path. A boolean mask
            # sends MLX CUDA down its unfused path, 7x slower at 128k (benchmarks/results/).
            keys, values = arrays["keys"][:, :, kv_start:end], arrays["values"][:, :, kv_start:end]
            mask = None if M == 1 else "causal"
        else:
            keys, values = arrays["keys"][:, :, :end], arrays["values"][:, :, :end]
            mask = attention_mask(mx.arange(end), q_pos, kv_start)
    else:
        keys, values = arrays["keys"], arrays["values"]
        mask = attention_mask(kv.slot_positions(layer, end), q_pos, kv_start, spec.window)
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=scale, mask=mask, sinks=sinks
    )


def _check_queries(kv: KvCacheManager, layer: int, queries: mx.array, sinks: mx.array | None) -> None:
    spec = kv.specs[layer]
    if not isinstance(queries, mx.array) or queries.ndim != 4:
        raise ValueError(f"layer {layer}: queries must be a 4-D mx.array (B, Hq, M, D)")
    if not mx.issubdtype(queries.dtype, mx.floating):
        raise TypeError(f"layer {layer}: queries must be floating point, got {queries.dtype}")
    B, Hq, M, D = queries.shape
    if B != kv.batch_size:
        raise ValueError(f"layer {layer}: batch size {B} does not match the cache's {kv.batch_size}")
    if D != spec.head_dim:
        raise ValueError(f"layer {layer}: query head_dim {D}, the layer has {spec.head_dim}")
    if Hq % spec.n_kv_heads:
        raise ValueError(f"layer {layer}: {Hq} query heads is not a multiple of {spec.n_kv_heads} KV heads")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"layer {layer}: sinks must have shape ({Hq},), got {tuple(sinks.shape)}")
