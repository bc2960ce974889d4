"""The plain-mx backend and the oracles of every kernel (the `_ref` functions).

TurboQuant_mse (arXiv 2504.19874, Algorithm 1):

    quantize:    y = Π (x / ||x||);  idx_j = #{boundaries < y_j};  store (idx, ||x||)
    dequantize:  x̂ = ||x|| · Πᵀ c[idx]

and attention computed in the rotated space, straight from the codes:

    q' = Π_K q;  s_i = scale · ||k_i|| · Σ_j q'_j c_K[idx_ij]
    p = softmax(s, sink);  o' = Σ_i p_i ||v_i|| c_V[idx_v_i];  o = Π_Vᵀ o'

These run on the CPU backend and are what `turbospark_mlx.gpu`'s kernels are tested
against. The QJL ("prod") variant of the paper is left out: it removes inner-product
bias but adds variance that softmax amplifies.
"""

from __future__ import annotations

import mlx.core as mx

from .packing import pack_indices, unpack_indices
from .tables import LayerQuant, SideQuant

# Keys per block of the reference TurboQuant attention (bounds its float32 working set).
REF_KEY_BLOCK = 256


# Largest y.size * boundaries for which the cell index is one broadcast comparison, whose
# boolean transient is that many bytes (4 MiB): a decode step's rows take it, 3 ops in all
# instead of the search's 4 per bit (benchmarks/results/cpu_speed.md has the step it serves).
COMPARE_ALL_MAX = 1 << 22


def nearest_index_ref(y: mx.array, boundaries: mx.array, bits: int) -> mx.array:
    """Index of the Lloyd-Max cell of each y: the count of boundaries strictly below it.

    Few rows: y against every boundary at once. Otherwise a branchless binary search (bits
    steps of one gather), so memory stays O(size of y) even for 8-bit codebooks. Both count
    the same strict comparisons, so they give the same indices.
    """
    if y.size * boundaries.size <= COMPARE_ALL_MAX:
        return (y[..., None] > boundaries).sum(axis=-1).astype(mx.uint32)
    idx = mx.zeros(y.shape, dtype=mx.uint32)
    for step in (1 << s for s in reversed(range(bits))):
        probe = mx.take(boundaries, idx + (step - 1))
        idx = idx + mx.where(y > probe, step, 0).astype(mx.uint32)
    return idx


def quantize_ref(x: mx.array, tables: SideQuant) -> tuple[mx.array, mx.array]:
    """(..., d) vectors → ((..., words) uint32 codes, (...,) float32 norms)."""
    x = x.astype(mx.float32)
    norms = mx.sqrt(mx.sum(x * x, axis=-1))
    # A zero vector maps to the middle cell and decodes to 0 through its norm.
    unit = x / mx.maximum(norms, 1e-30)[..., None]
    idx = nearest_index_ref(tables.rotation.apply(unit), tables.boundaries, tables.bits)
    return pack_indices(idx, tables.bits), norms


def centroids_of(codes: mx.array, tables: SideQuant) -> mx.array:
    """c[idx] of (..., words) packed codes: (..., d) float32.

    Where the bits allow, one gather per 16-bit half word (`SideQuant.half_word_table`);
    otherwise the indices are unpacked and gathered one by one. Both give the same values.
    """
    table = tables.half_word_table
    if table is None:
        return mx.take(tables.centroids, unpack_indices(codes, tables.bits, tables.head_dim))
    rows = mx.take(table, codes.view(mx.uint16), axis=0)  # (..., 2 * words, 16 // bits)
    rows = rows.reshape(*codes.shape[:-1], -1)
    return rows if rows.shape[-1] == tables.head_dim else rows[..., : tables.head_dim]


def dequantize_rotated_ref(codes: mx.array, norms: mx.array, tables: SideQuant) -> mx.array:
    """||x|| · c[idx]: the reconstruction in the rotated space, float32."""
    return centroids_of(codes, tables) * norms[..., None]


def dequantize_ref(codes: mx.array, norms: mx.array, tables: SideQuant) -> mx.array:
    """x̂ = ||x|| · Πᵀ c[idx], float32."""
    return tables.rotation.invert(dequantize_rotated_ref(codes, norms, tables))


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
    dense: tuple[mx.array, mx.array, mx.array] | None = None,
    key_mean: mx.array | None = None,
) -> mx.array:
    """TurboQuant attention from packed codes, computed in the rotated space.

    Args:
        queries: (B, Hq, M, D).
        k_codes, v_codes: (B, Hkv, L, words) uint32; k_norms, v_norms: (B, Hkv, L) float32.
        quant: the layer's K and V tables.
        mask: (B or 1, 1, M, L) bool, True where a key is visible.
        sinks: (Hq,) per-head sink logits, or None.
        dense: FP16 rows attended in the same softmax: (keys, values, mask) with keys and
            values (B, Hkv, Ld, D) and mask (B or 1, 1, M, Ld), or None when every row sees all
            of them (a layer's window and sink rows).
        key_mean: (B, Hkv, D) mean subtracted from the keys before quantizing: q·mean is
            added to the scores of quantized keys, so all keys share one score scale.
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

    def merge(part):
        nonlocal m, denom, acc
        pm, pl, po = part
        m_new = mx.maximum(m, pm)
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # rows that have seen no key yet
        alpha, beta = mx.exp(m - m_safe), mx.exp(pm - m_safe)
        denom = denom * alpha + pl * beta
        acc = acc * alpha + po * beta
        m = m_new

    if dense is not None:
        merge(fp16_rows_partial_ref(queries, *dense, quant, scale))
    offset = 0.0
    if key_mean is not None:
        q = queries.astype(mx.float32).reshape(B, Hkv, G, M, D)
        offset = scale * (q @ key_mean.astype(mx.float32)[:, :, None, :, None])  # (B, Hkv, G, M, 1)
    for s in range(0, L, REF_KEY_BLOCK):
        e = min(L, s + REF_KEY_BLOCK)
        k_rot = dequantize_rotated_ref(k_codes[:, :, s:e], k_norms[:, :, s:e], quant.k)[:, :, None]
        v_rot = dequantize_rotated_ref(v_codes[:, :, s:e], v_norms[:, :, s:e], quant.v)[:, :, None]
        scores = scale * (q_rot @ k_rot.swapaxes(-1, -2)) + offset  # (B, Hkv, G, M, block)
        merge(_partial(scores, v_rot, None if mask is None else mask[:, :, :, s:e]))
    out = quant.v.rotation.invert(acc / denom)  # o = Π_Vᵀ o', once per step
    return out.reshape(B, Hq, M, D).astype(queries.dtype)


def _partial(scores: mx.array, v_rot: mx.array, visible: mx.array | None):
    """Softmax statistics of one block of keys: (row max, sum of exp(s - max), weighted V).
    A row that sees no key has max -inf, sum 0 and zero output."""
    if visible is not None:
        scores = mx.where(visible[:, :, None], scores, -mx.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = mx.exp(scores - mx.where(m == -mx.inf, 0.0, m))
    return m, p.sum(axis=-1, keepdims=True), p @ v_rot


def fp16_rows_partial_ref(
    queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, quant: LayerQuant, scale: float
) -> tuple[mx.array, mx.array, mx.array]:
    """The partial of FP16 rows (a protected layer's window and sink rows) in the rotated V
    space: scores need no rotation (q'·k' = q·k), V goes to Π_V v.

    Returns (m, l, o'), (B, Hkv, G, M, 1), (B, Hkv, G, M, 1) and (B, Hkv, G, M, D); the
    reference merges it with the codes' blocks, the GPU path hands it to the decode reduce.
    """
    B, Hq, M, D = queries.shape
    Hkv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, M, D)
    scores = scale * (q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2))  # (B, Hkv, G, M, Ld)
    return _partial(scores, quant.v.rotation.apply(values.astype(mx.float32))[:, :, None], mask)


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
