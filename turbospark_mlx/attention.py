"""Attention over the KV cache: one fan-out point for every layer kind.

`attention_any` forks on `cache.layer_quant(layer)`:
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
prefill reads the same rows token-by-token decode does (a protected layer's one-row
step takes its own path on the reference backend: equal to float32 rounding).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from .cache import KVCacheManager, store_kv, window
from .cache.window import ring_rows
from .gpu import backend as _backend
from .gpu.args import _ZEROS8, TABLES
from .gpu.decode import tq_decode_attention, tq_decode_unsupported
from .gpu.decode_mma import MmaLaunch, mma_launch
from .gpu.dequantize import tq_dequantize
from .quant.compiled import protected_step_ref
from .quant.reference import tq_attention_ref
from .quant.tables import SIDES

# Query rows from which a compressed layer's call on a GPU reads the history as rows decoded
# once per call (tq_dequantize) under MLX's fused attention, instead of the decode kernels,
# which re-read the codes for every few rows. Prefill chunks (2048 rows) take it, a
# speculative verify (a few rows) does not; the whole-model prefill it gives is in
# benchmarks/results/generate_e2e.md, the crossover between 4 and 2048 rows is not measured.
PREFILL_MIN_ROWS = 64
# Where MLX has no fused attention for a prefill call's shape (its CPU backend; head_dim above 128
# on CUDA), its attention holds the scores over the whole history: bytes of scores (4 per score)
# one such call may hold, so a chunk's rows go in blocks sized to this, one after another (at 128k
# keys and 32 query heads, 256 rows; a 2048-row chunk's scores would be 34 GB). At least 16 rows
# per block. Fused attention (cuDNN's on CUDA) holds no scores and takes the whole chunk: in blocks
# of 64 or 256 rows a 128k prefill ran at 0.23x and 0.57x FP16's tokens/s on the H200
# (benchmarks/results/generate_e2e.md), each block re-reading the history with a partly idle grid.
PREFILL_SCORE_BYTES = 4 << 30
# Prefill calls of compressed layers left running while the host builds the next layer: each
# holds its layer's decoded history. Waiting for each layer's queries before building its call
# left the GPU idle meanwhile: tq4 prefill at 4k was 0.90x FP16's tokens/s that way, 1.01x with
# 2 in flight (H200, one run; benchmarks/results/generate_e2e.md has the shipped numbers).
PREFILL_IN_FLIGHT = 2
# Prefill calls started and not yet waited for, of every cache: the GPU runs one stream, and
# mlx-lm's drop-in holds one cache per layer. (The last ones stay referenced, outputs only, until
# the next prefill.)
_PREFILL_PENDING: list[mx.array] = []


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


def store_and_attend(
    cache: KVCacheManager,
    layer: int,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    position: int,
    *,
    scale: float | None = None,
    sinks: mx.array | None = None,
    kv_start: int | mx.array = 0,
) -> mx.array:
    """Write M rows of keys and values at `position`, commit them, and attend with M query rows
    at the same positions: `store_kv` then `attention_any`, the write path of one attention
    block. Three layer kinds take a step prepared once per call shape instead, with the same
    result and less host work per call: a growing FP16 layer (`GrowingStep`: two slice updates
    and MLX's fused attention, as mlx-lm's KVCache), a sliding-window FP16 ring's decode step
    (`RingStep`: the same over the window's slots, as mlx-lm's RotatingKVCache), and a protected
    layer's decode step on CUDA (`ProtectedStep`: one launch, two on a commit step)."""
    step = _planned_step(cache, layer, queries, keys, values, position, scale, sinks, kv_start)
    if step is not None:
        return step(cache, layer, queries, keys, values, position, kv_start, sinks)
    # Queries and start are checked before the write, so a bad call leaves the cache as it was.
    _check_queries(cache, layer, queries, sinks)
    _check_start(layer, kv_start, position)
    store_kv(cache, layer, position, keys, values)
    return _attend(cache, layer, queries, position, scale, sinks, kv_start)


def attention_any(
    cache: KVCacheManager,
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
        cache: the cache.
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
    _check_queries(cache, layer, queries, sinks)
    if position is None:
        position = cache.layer_offset(layer) - queries.shape[2]
    _check_start(layer, kv_start, position)
    return _attend(cache, layer, queries, position, scale, sinks, kv_start)


def _check_start(layer: int, kv_start: int | mx.array, position: int) -> None:
    # Read the start(s) on the host: an mx reduction + .item() here would cost a GPU sync per layer.
    latest_start = kv_start if isinstance(kv_start, int) else int(np.asarray(kv_start).max())
    if latest_start > position:
        raise ValueError(f"layer {layer}: kv_start {kv_start} is past the first query position {position}")


def _attend(cache, layer, queries, position, scale, sinks, kv_start) -> mx.array:
    """`attention_any` once the queries and the start are checked."""
    spec = cache.specs[cache.owner(layer)]
    B, Hq, M, D = queries.shape
    committed = cache.layer_offset(layer)
    if position < 0 or position + M > committed:
        raise ValueError(
            f"layer {layer}: queries at positions [{position}, {position + M}) but only {committed} are committed"
        )
    scale = D**-0.5 if scale is None else scale
    end = position + M
    arrays = cache.layer_arrays(layer)
    quant = cache.layer_quant(layer)

    if quant is not None:
        backend = _backend.current_backend()
        if backend != "reference":  # the kernels' plan is only worth working out for a kernel
            backend = _backend.resolve(tq_decode_unsupported(quant, Hq // spec.n_kv_heads, D))
        # A bounded layer's codes are a ring: its rows take _protected_attention's paths.
        if backend != "reference" and M >= PREFILL_MIN_ROWS and cache.layer_keep(layer) is None:
            return _prefill_attention(cache, layer, queries, position, scale, sinks, kv_start, backend)
        if cache.config.is_protected:
            return _protected_attention(cache, layer, queries, position, scale, sinks, kv_start, backend)
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
        mask = attention_mask(mx.arange(end), mx.arange(position, end), kv_start)
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

    if cache.ring_capacity(layer) is None:
        if isinstance(kv_start, int):
            # Plain causal attention over [kv_start, end): MLX's fused path. A boolean mask
            # sends MLX CUDA down its unfused path, 7x slower at 128k (H200, MLX 0.32.4).
            keys, values = arrays["keys"][:, :, kv_start:end], arrays["values"][:, :, kv_start:end]
            mask = None if M == 1 else "causal"
        else:
            keys, values = arrays["keys"][:, :, :end], arrays["values"][:, :, :end]
            mask = attention_mask(mx.arange(end), mx.arange(position, end), kv_start)
    else:
        keys, values = arrays["keys"], arrays["values"]
        q_pos = mx.arange(position, end)
        kp = cache.slot_positions(layer, end)
        S = cache.sink_rows(layer)
        mask = attention_mask(kp, q_pos, kv_start, cache.layer_keep(layer))
        if S:  # a bounded ring: its first positions from their own rows, not the ring's copies
            n = min(S, end)
            keys = mx.concatenate([arrays["k_sinks"][:, :, :n], keys], axis=2)
            values = mx.concatenate([arrays["v_sinks"][:, :, :n], values], axis=2)
            sink_mask = attention_mask(mx.arange(n), q_pos, kv_start)
            mask = mx.concatenate([mx.broadcast_to(sink_mask, (*mask.shape[:3], n)), mask & (kp >= S)], axis=-1)
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=scale, mask=mask, sinks=sinks
    )


def _prefill_attention(cache, layer, queries, position, scale, sinks, kv_start, backend) -> mx.array:
    """M query rows of a compressed layer over its history decoded to rows of the queries'
    dtype (one dequantize launch per side) under `mx.fast.scaled_dot_product_attention`,
    causal inside the chunk. A protected layer's positions from its committed end before the
    chunk on come from its FP16 ring: each row reads at least the FP16 rows a one-token step
    reads."""
    # Wait for the call PREFILL_IN_FLIGHT calls back, so that at most that many layers' decoded
    # histories are alive while the GPU keeps the later ones queued.
    pending = _PREFILL_PENDING
    while len(pending) >= PREFILL_IN_FLIGHT:
        mx.eval(pending.pop(0))
    config, arrays, quant = cache.config, cache.layer_arrays(layer), cache.layer_quant(layer)
    M, dt = queries.shape[2], queries.dtype
    end = position + M
    k_mean = arrays.get("k_mean") if config.center_keys else None
    sides = {}
    for s in SIDES:
        mean = k_mean if s == "k" else None
        if not config.is_protected:
            sides[s] = tq_dequantize(arrays[f"{s}_codes"], arrays[f"{s}_norms"], quant.side(s), end, dt, None, backend)
            continue
        S = config.sink_rows
        lo = min(cache.quantized_end(layer, position), end)  # positions [lo, end) from the ring
        parts = [arrays[f"{s}_sinks"][:, :, : min(S, end)].astype(dt)]
        if lo > S:
            codes, norms = arrays[f"{s}_codes"], arrays[f"{s}_norms"]
            parts.append(tq_dequantize(codes, norms, quant.side(s), lo - S, dt, mean, backend))
        if end > lo:
            parts.append(ring_rows(arrays[f"{s}_recent"], lo, end, cache.recent_capacity(layer)).astype(dt))
        sides[s] = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    keys, values = sides["k"], sides["v"]
    sinks = None if sinks is None else sinks.astype(dt)  # MLX's fused attention takes them in the output dtype

    def rows(a: int, b: int, q: mx.array, fused: bool) -> mx.array:
        """Query rows [a, b) of the chunk; they see keys up to their own positions."""
        e = position + b
        if isinstance(kv_start, int):
            k, v, mask = keys[:, :, kv_start:e], values[:, :, kv_start:e], "causal"
        else:
            mask = attention_mask(mx.arange(e), mx.arange(position + a, e), kv_start)
            k, v = keys[:, :, :e], values[:, :, :e]
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=fused
        )

    try:  # a fused kernel (cuDNN's on CUDA) holds no scores: the whole chunk in one call
        out = rows(0, M, queries, fused=True)
    except ValueError:  # MLX has no fused kernel for this shape: its unfused attention holds the
        # scores, so the rows go in blocks whose scores fit the budget, one after another
        block = max(16, PREFILL_SCORE_BYTES // (4 * queries.shape[0] * queries.shape[1] * end))
        outs = []
        for a in range(0, M, block):
            b = min(M, a + block)
            q = mx.depends(queries[:, :, a:b], outs[-1]) if outs else queries[:, :, a:b]
            outs.append(rows(a, b, q, fused=False))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    # Started here and waited for PREFILL_IN_FLIGHT calls later (evaluated with the whole chunk,
    # every layer's decoded history would be alive at once) while the host builds the next ones.
    mx.async_eval(out)
    pending.append(out)
    return out


def _protected_attention(cache, layer, queries, position, scale, sinks, kv_start, backend) -> mx.array:
    """A protected TurboQuant layer: each query row t reads its sink rows and the positions
    from committed_end(t + 1) (the window and the rows of an unfinished commit block) in FP16
    and older positions from the codes, in one softmax (on a bounded layer only those after
    t - keep)."""
    config, arrays, quant = cache.config, cache.layer_arrays(layer), cache.layer_quant(layer)
    S, W, keep = config.sink_rows, config.window_rows, cache.layer_keep(layer)
    B, Hq, M, D = queries.shape
    if backend == "reference" and M == 1 and isinstance(kv_start, int):
        return _protected_step_ref(cache, layer, queries, position, scale, sinks, kv_start)
    end = position + M
    # Every row reads codes: the decode step's path.
    if backend == "cuda" and keep is None and cache.quantized_end(layer, position + 1) > S:
        out = _protected_mma(cache, layer, queries, position, scale, sinks, kv_start)
        if out is not None:
            return out
    t = mx.arange(position, end)[:, None]  # (M, 1) query positions
    start = mx.array(kv_start).reshape(-1, 1, 1, 1)
    # FP16 rows: the sink rows from their array, the window from the ring.
    n_sinks = min(S, end)
    sp = mx.arange(n_sinks)[None, :]
    rp = cache.recent_positions(layer, end)[None, :]  # -1 where unwritten
    fp16_from = config.committed_end(t + 1)  # (M, 1): the first ring position each row reads
    # The ring's copies of sink rows are not read.
    ring_mask = (rp >= S) & (rp >= 0) & (rp <= t) & (rp >= fp16_from)
    if keep is not None:  # a commit block may leave more FP16 rows than the layer keeps
        ring_mask &= rp > t - keep
    positions = mx.concatenate([sp, rp], axis=1)
    dense_mask = mx.concatenate([sp <= t, ring_mask], axis=1)[None, None] & (positions[None, None] >= start)
    keys = mx.concatenate([arrays["k_sinks"][:, :, :n_sinks], arrays["k_recent"]], axis=2)
    values = mx.concatenate([arrays["v_sinks"][:, :, :n_sinks], arrays["v_recent"]], axis=2)
    # Codes: positions [S, q_end) in slots [0, q_end - S); row t reads those below fp16_from.
    q_end = cache.quantized_end(layer, end)
    key_mean = arrays["k_mean"] if config.center_keys and q_end > S else None
    if "k_codes" in arrays:
        codes = [arrays[n] for n in ("k_codes", "k_norms", "v_codes", "v_norms")]
    else:  # no row has left the window yet: zero-length codes
        n = (B, keys.shape[1], 0)
        codes = [mx.zeros((*n, quant.k.words), mx.uint32), mx.zeros(n), mx.zeros((*n, quant.v.words), mx.uint32), mx.zeros(n)]
    # A bounded layer's chunk rows each start at their own position (t - keep, ...]: the
    # kernels take one start per sequence, so those rows go the reference way (on any device).
    if backend == "reference" or (keep is not None and M > 1):
        if keep is None:
            kp, codes = mx.arange(S, q_end)[None, :], [c[:, :, : q_end - S] for c in codes]
        else:
            kp = cache.code_positions(layer, end)[None, :]
        code_mask = ((kp >= 0) & (kp < fp16_from) & (kp > t - (keep or end)))[None, None]
        code_mask &= kp[None, None] >= start
        return tq_attention_ref(
            queries, *codes, quant, scale=scale, mask=code_mask,
            sinks=sinks, dense=(keys, values, dense_mask), key_mean=key_mean,
        )
    lo = S  # the kernel sees code slot i as position lo + i
    if keep is not None:  # one row: its codes after t - keep, in order (at most two slices)
        lo = max(S, position - keep + 1)
        codes = [ring_rows(c, lo - S, max(lo, q_end) - S, cache.ring_capacity(layer)) for c in codes]
    # Leading rows whose codes end at or before lo read none (the kernel's first position would
    # be negative): committed_end grows with the row, so they come first.
    r0 = sum(1 for p in range(position, end) if config.committed_end(p + 1) <= lo)
    out = []
    if r0:
        out.append(tq_attention_ref(
            queries[:, :, :r0], *(c[:, :, :0] for c in codes), quant, scale=scale,
            sinks=sinks, dense=(keys, values, dense_mask[:, :, :r0]),
        ))
    if r0 < M:
        shifted = mx.maximum(kv_start - lo, 0) if isinstance(kv_start, mx.array) else max(kv_start - lo, 0)
        if keep is None:  # slot i holds position S + i: the kernel floors row t's t + 1 - W - S to blocks
            first, blocks = position + r0 - W - S, config.commit_rows
        else:  # one row (more go the reference way); slot i holds position lo + i
            first, blocks = config.committed_end(position + 1) - 1 - lo, 1
        out.append(tq_decode_attention(
            queries[:, :, r0:], *codes, quant, scale=scale, position=first,
            kv_start=shifted, sinks=sinks, backend=backend,
            dense=(keys, values, dense_mask[:, :, r0:]), key_mean=key_mean, commit_rows=blocks,
        ))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def _protected_step_ref(cache, layer, queries, position, scale, sinks, kv_start: int) -> mx.array:
    """One query row of a protected layer on the reference backend (a decode step): only the
    rows it reads go in, so no position mask is built. Its sink rows and the FP16 rows from
    committed_end(t + 1) are sliced from their arrays; before any row has codes this is MLX's
    fused attention over them, after it the codes join in one softmax (one compiled graph)."""
    config, arrays, quant = cache.config, cache.layer_arrays(layer), cache.layer_quant(layer)
    S, R = config.sink_rows, cache.recent_capacity(layer)
    keep = cache.layer_keep(layer)
    t = position
    # The first ring position read.
    lo = max(kv_start, config.committed_end(t + 1), 0 if keep is None else t - keep + 1)
    dense = []
    for side in ("k", "v"):
        # No codes, nothing dropped (bounded), and the ring holds [0, t] in slots [0, t]: one slice
        if t < R and config.committed_end(t + 1) == S and (keep is None or t < S + keep):
            dense.append(arrays[f"{side}_recent"][:, :, kv_start : t + 1])
            continue
        rows = [arrays[f"{side}_sinks"][:, :, kv_start : min(S, t + 1)]] if kv_start < S else []
        if lo <= t:
            rows.append(ring_rows(arrays[f"{side}_recent"], lo, t + 1, R))
        dense.append(rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=2) if rows else None)
    keys, values = dense
    q_end = cache.quantized_end(layer, t + 1)  # codes for positions [S, q_end)
    first = max(S, kv_start, t - keep + 1) if keep is not None else max(S, kv_start)
    if q_end <= first:  # float32, as the reference computes the rows of a chunk
        f32 = [a.astype(mx.float32) for a in (queries, keys, values)]
        return mx.fast.scaled_dot_product_attention(*f32, scale=scale, sinks=sinks).astype(queries.dtype)
    names = ("k_codes", "k_norms", "v_codes", "v_norms")
    if keep is None:
        codes, rows = [arrays[n] for n in names], (first - S, q_end - S)
    else:  # code slot (p - S) modulo the ring, gathered in order
        codes = [ring_rows(arrays[n], first - S, q_end - S, cache.ring_capacity(layer)) for n in names]
        rows = (0, q_end - first)
    key_mean = arrays["k_mean"] if config.center_keys else None
    out = protected_step_ref(queries, keys, values, codes, rows, quant, scale=scale, sinks=sinks, key_mean=key_mean)
    if out is not None:
        return out
    codes = [c[:, :, rows[0] : rows[1]] for c in codes]
    return tq_attention_ref(
        queries, *codes, quant, scale=scale, sinks=sinks, key_mean=key_mean,
        dense=None if keys is None else (keys, values, None),
    )  # fmt: skip


def _protected_mma(cache, layer, queries, position, scale, sinks, kv_start) -> mx.array | None:
    """A protected layer on CUDA in one launch of the tensor-core kernel, which reads the codes
    and the FP16 rows (DENSE). None if it cannot take these rows in one launch."""
    config, arrays, quant = cache.config, cache.layer_arrays(layer), cache.layer_quant(layer)
    Hkv = arrays["k_recent"].shape[1]
    dense = _dense_config(config, cache.recent_capacity(layer), arrays)
    mma = mma_launch(
        quant, queries, Hkv, scale, isinstance(kv_start, mx.array), sinks is not None, dense=dense,
        commit_rows=config.commit_rows,
    )  # fmt: skip
    if mma.reason is not None or mma.per < queries.shape[2]:
        return None
    # Code slot i holds position i + S, and row t reads the slots below committed_end(t + 1) - S,
    # which the kernel takes as t + 1 - W - S floored to whole commit blocks.
    first = position - config.window_rows - config.sink_rows
    dense_rows = _dense_rows(arrays, config.sink_rows)
    return mma(queries, *_codes(arrays), first, kv_start, sinks, dense_rows=dense_rows)


def _dense_config(config, ring_slots: int, arrays: dict) -> tuple:
    """The tensor-core kernel's DENSE configuration of a protected layer (decode_mma._mma_config)."""
    return (config.sink_rows, config.window_rows, ring_slots, "k_mean" in arrays)


def _dense_rows(arrays: dict, sink_rows: int) -> list[mx.array]:
    """The tensor-core kernel's DENSE inputs: sink rows (the ring's arrays where there are none,
    never read), ring, key mean (a placeholder where there is none)."""
    ring = arrays["k_recent"], arrays["v_recent"]
    sinks = (arrays["k_sinks"], arrays["v_sinks"]) if sink_rows else ring
    return [*sinks, *ring, arrays.get("k_mean", _ZEROS8)]


def _codes(arrays: dict) -> list[mx.array]:
    """A compressed layer's codes and norms, in the kernels' order."""
    return [arrays[n] for n in _CODES]


def _check_queries(cache: KVCacheManager, layer: int, queries: mx.array, sinks: mx.array | None) -> None:
    spec = cache.specs[layer]
    if not isinstance(queries, mx.array) or queries.ndim != 4:
        raise ValueError(f"layer {layer}: queries must be a 4-D mx.array (B, Hq, M, D)")
    if not mx.issubdtype(queries.dtype, mx.floating):
        raise TypeError(f"layer {layer}: queries must be floating point, got {queries.dtype}")
    B, Hq, M, D = queries.shape
    if B != cache.batch_size:
        raise ValueError(f"layer {layer}: batch size {B} does not match the cache's {cache.batch_size}")
    if D != spec.head_dim:
        raise ValueError(f"layer {layer}: query head_dim {D}, the layer has {spec.head_dim}")
    if Hq % spec.n_kv_heads:
        raise ValueError(f"layer {layer}: {Hq} query heads is not a multiple of {spec.n_kv_heads} KV heads")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"layer {layer}: sinks must have shape ({Hq},), got {tuple(sinks.shape)}")


class ProtectedStep:
    """The decode step of a protected TurboQuant layer on CUDA for one call shape, as
    `store_kv` + `attention_any` compute it: the new row goes into the FP16 ring (two slice
    updates), and on the step that completes a commit block `tq_commit` quantizes the block and
    its codes go into their slots (four slice updates); then one tensor-core launch reads the
    codes and the FP16 rows. Launch objects and shapes are built once (a decode step calls this
    for every layer; host time bounds the step, docs/decode_kernels.md). `usable` says whether
    the kernel takes the shape."""

    def __init__(
        self, cache: KVCacheManager, l, queries: mx.array, scale: float, starts: bool, has_sink: bool
    ) -> None:
        config = cache.config
        self.S, self.R, self.B = config.sink_rows, l.recent_capacity, config.commit_rows
        self.first_offset = config.window_rows + config.sink_rows
        # The first position whose row reads codes (committed_end(p) > sink_rows from it on).
        self.first_read = self.first_offset + config.commit_rows
        self.has_mean = "k_mean" in l.arrays
        self.dtype, self.rows = cache.dtype, queries.shape[2]
        self.mma: MmaLaunch = mma_launch(
            l.quant, queries, l.spec.n_kv_heads, scale, starts, has_sink,
            dense=_dense_config(config, self.R, l.arrays), commit_rows=config.commit_rows,
        )  # fmt: skip
        self.usable = self.mma.reason is None and self.mma.per >= self.rows

    def __deepcopy__(self, memo) -> "ProtectedStep":
        return self  # a plan shared by every cache of its configuration, never changed by a call

    def takes(self, cache, l, position: int, kv_start) -> bool:
        """Whether this call is the step's (`_planned_step` asked for CUDA): the row at the
        layer's end reading codes (the key mean set), the ring at its full size, a start at most
        the row's position (past it, the general path names the problem)."""
        a = l.arrays
        if (
            position != l.offset
            or position < self.first_read
            or a["k_recent"].shape[2] != self.R
            or ("k_mean" in a) != self.has_mean
        ):  # fmt: skip
            return False
        if isinstance(kv_start, int):
            return kv_start <= position
        return isinstance(kv_start, mx.array) and int(np.asarray(kv_start).max()) <= position

    def __call__(self, cache, layer, queries, keys, values, position, kv_start, sinks) -> mx.array:
        l = cache._layers[layer]
        a = l.arrays
        s = position % self.R
        if keys.dtype != self.dtype:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        a["k_recent"][:, :, s : s + 1] = keys
        a["v_recent"][:, :, s : s + 1] = values
        # The row completes a commit block where committed_end(position + 1) moves (rows past
        # first_read only): then window.commit quantizes the block (tq_commit).
        if (position + 1 - self.first_offset) % self.B == 0:
            window.commit(cache, l, position, 1)
        l.offset = position + 1
        return self.mma.launch(
            queries, a["k_codes"], a["k_norms"], a["v_codes"], a["v_norms"], _dense_rows(a, self.S),
            position - self.first_offset, kv_start, sinks,
        )  # fmt: skip


_CODES = ("k_codes", "k_norms", "v_codes", "v_norms")


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


class GrowingStep:
    """M rows of a growing FP16 layer for one call shape, as `store_kv` + `attention_any` compute
    them: the rows go into their slots (two slice updates; storage grows in whole steps) and the
    queries attend over positions [kv_start, end) with MLX's fused attention, causal inside the
    rows, which is mlx-lm's KVCache step. `_planned_step` checked the shape once; a call only
    re-checks what moves. (Through the general path the own llama's FP16 decode step took ~1.4x
    the host time of mlx-lm's; docs/decode_kernels.md, "Inside the whole model".)"""

    def __init__(self, cache: KVCacheManager, queries: mx.array, scale: float | None) -> None:
        self.dtype, self.rows = cache.dtype, queries.shape[2]
        self.scale = queries.shape[3] ** -0.5 if scale is None else scale
        self.mask = None if self.rows == 1 else "causal"

    def __deepcopy__(self, memo) -> "GrowingStep":
        return self  # never changed by a call

    def takes(self, cache, l, position: int, kv_start) -> bool:
        """Whether this call is the step's: rows at the layer's end, an int start at most the
        position, within the cache's context limit (else the general path names the problem)."""
        return (
            isinstance(kv_start, int) and 0 <= kv_start <= position == l.offset
            and (cache.max_context is None or position + self.rows <= cache.max_context)
        )  # fmt: skip

    def __call__(self, cache, layer, queries, keys, values, position, kv_start, sinks) -> mx.array:
        l, end = cache._layers[layer], position + self.rows
        if end > l.capacity:
            cache._reserve(l, end)
        a = l.arrays
        if keys.dtype != self.dtype:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        a["keys"][:, :, position:end] = keys
        a["values"][:, :, position:end] = values
        l.offset = end
        k, v = a["keys"][:, :, kv_start:end], a["values"][:, :, kv_start:end]
        if k.dtype != queries.dtype:
            k, v = k.astype(queries.dtype), v.astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=self.scale, mask=self.mask, sinks=sinks
        )


class RingStep:
    """M rows of a sliding-window FP16 ring (no sink rows) for one call shape, as `store_kv` +
    `attention_any` compute them: the rows go into slots position % capacity and the queries
    attend over positions [max(kv_start, position - keep + 1), end) read in position order (one
    slice, or two joined where they wrap: `ring_rows`), as mlx-lm's RotatingKVCache attends. One
    row reads its window without a mask; a chunk whose rows all see every key read takes the
    causal mask, and a longer one the band of `_window_mask`, built once per shape and shared by
    the layers and chunks. Through the general path every call builds the ring's slot positions
    and a mask over all its window + max_rows - 1 slots, per layer."""

    def __init__(self, l, cache: KVCacheManager, queries: mx.array, scale: float | None) -> None:
        self.dtype, self.rows = cache.dtype, queries.shape[2]
        self.scale = queries.shape[3] ** -0.5 if scale is None else scale
        self.R, self.keep = l.ring_capacity, l.keep

    def __deepcopy__(self, memo) -> "RingStep":
        return self  # never changed by a call

    def takes(self, cache, l, position: int, kv_start) -> bool:
        """Whether this call is the step's: rows at the layer's end, an int start at most the position."""
        return isinstance(kv_start, int) and 0 <= kv_start <= position == l.offset

    def __call__(self, cache, layer, queries, keys, values, position, kv_start, sinks) -> mx.array:
        l, R, M = cache._layers[layer], self.R, self.rows
        end = position + M
        if end > l.capacity and l.capacity < R:
            cache._reserve(l, end)
        if keys.dtype != self.dtype:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        cache._put(l, "keys", position, keys)
        cache._put(l, "values", position, values)
        l.offset = end
        lo = max(kv_start, position + 1 - self.keep)  # the oldest position the first row reads
        k, v = ring_rows(l.arrays["keys"], lo, end, R), ring_rows(l.arrays["values"], lo, end, R)
        if k.dtype != queries.dtype:
            k, v = k.astype(queries.dtype), v.astype(queries.dtype)
        offset = position - lo
        if M == 1:
            mask = None
        elif offset + M <= self.keep:  # no row's window starts after lo
            mask = "causal"
        else:
            mask = _window_mask(M, offset, self.keep)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=self.scale, mask=mask, sinks=sinks)


@functools.lru_cache(maxsize=8)
def _window_mask(rows: int, offset: int, window: int) -> mx.array:
    """`attention_mask` of `rows` queries at key indices offset.. over offset + rows keys read in
    position order under a sliding window (mlx-lm's `create_causal_mask(rows, offset, window)`).
    A prefill's chunks after the first share one shape, so the mask is built once for them all."""
    return attention_mask(mx.arange(offset + rows), mx.arange(offset, offset + rows), 0, window)


def _planned_step(
    cache, layer, queries, keys, values, position, scale, sinks, kv_start
) -> GrowingStep | RingStep | ProtectedStep | None:
    """The step prepared for this call (`GrowingStep`, `RingStep`, `ProtectedStep`), or None
    where the general path serves it: another layer kind (a ring with sink rows, a bounded
    protected layer, an unprotected TurboQuant layer), a protected layer off CUDA, rows that do
    not match the layer (the general path names the problem), a half-done write, or what the
    step's `takes` refuses. The layer keeps the step of its last call shape
    (`_Layer.step_plan`), so a decode step only re-checks what changes from step to step."""
    l = cache._layers.get(layer)
    if l is None or cache.stage.pending:
        return None
    if l.quant is not None or l.sink_rows:  # the own steps: growing / ring FP16, protected on CUDA
        if not l.recent_capacity or l.keep is not None or _backend.current_backend() != "cuda":
            return None
    if not (isinstance(queries, mx.array) and isinstance(keys, mx.array) and isinstance(values, mx.array)):
        return None
    sig = (queries.shape, keys.shape, values.shape, queries.dtype, keys.dtype, values.dtype, scale,
           sinks is None, isinstance(kv_start, mx.array))  # fmt: skip
    plan = l.step_plan
    if plan is None or plan[0] != sig:
        plan = l.step_plan = (sig, _new_step(cache, l, queries, keys, values, scale, sinks, sig[-1]))
    step = plan[1]
    if step is None or not step.takes(cache, l, position, kv_start):
        return None
    return step


def _new_step(cache, l, queries, keys, values, scale, sinks, starts: bool):
    """The step of a call shape on layer `l`, or None if its kind's step cannot take it."""
    B, H, D = cache.batch_size, l.spec.n_kv_heads, l.spec.head_dim
    qs, M = queries.shape, keys.shape[2] if keys.ndim == 4 else 0
    ok = (
        M >= 1 and keys.shape == (B, H, M, D) and values.shape == keys.shape
        and len(qs) == 4 and qs[0] == B and qs[2] == M and qs[3] == D and qs[1] % H == 0
        and all(x.dtype in _FLOATS for x in (queries, keys, values))
        and (sinks is None or sinks.shape == (qs[1],))
    )  # fmt: skip
    if not ok:
        return None
    if l.quant is not None:
        return _new_protected_step(cache, l, queries, scale, sinks, starts)
    if starts:
        return None
    if l.ring_capacity is None:
        return GrowingStep(cache, queries, scale)
    return RingStep(l, cache, queries, scale) if M <= cache.max_rows else None  # slots beyond the window


def _new_protected_step(cache, l, queries, scale, sinks, starts: bool) -> ProtectedStep | None:
    """The ProtectedStep of a call shape whose rows match the layer, shared by the caches of
    one configuration (TABLES, per quantizer); None if the tensor-core kernel cannot take it."""
    if queries.shape[2] != 1:  # a decode step: the fused multi-row commit has no GPU test
        return None
    window.fit(cache, l, l.offset, 1)  # a chunk's room given back before the step is planned
    config, a = cache.config, l.arrays
    scale = l.spec.head_dim**-0.5 if scale is None else scale
    cached = TABLES.get(l.quant.k) or TABLES.setdefault(l.quant.k, {})
    key = ("step", l.quant.v, queries.shape, queries.dtype, cache.dtype, scale, starts, sinks is not None,
           config.sink_rows, config.window_rows, config.commit_rows, l.recent_capacity,
           "k_mean" in a)  # fmt: skip
    step = cached.get(key)
    if step is None:
        step = cached[key] = ProtectedStep(cache, l, queries, scale, starts, sinks is not None)
    return step if step.usable else None
