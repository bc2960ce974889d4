"""Decode attention over a packed cache: M query rows of each sequence, causally.

`tq_decode_attention` is the entry point on a GPU backend; `quant.reference.tq_attention_ref`
is its twin. Two kernels serve it:
* the dialect kernels, one source for Metal and CUDA: `kernels/tq_decode_attention.kernel`
  (flash-decoding tiles) + `kernels/tq_decode_reduce.kernel`. The query is rotated once per
  threadgroup inside pass 1 and the output rotated back once per row inside the reduce, so
  a call is two launches;
* on CUDA, the tensor-core kernel of `decode_mma.py` (one launch), which the automatic
  choice takes for long contexts at the head dims where it measures faster.
`*_unsupported` say why a kernel cannot serve a configuration (None: it can);
`backend.resolve` turns that into an error or a warned fallback, never a silent one.
See docs/decode_kernels.md.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from ..quant.reference import fp16_rows_partial_ref
from ..quant.tables import LayerQuant
from . import backend as _backend
from .args import bits_reason, padded_table, rotation_arg, sinks_arg, step_args
from .build import launch
from .decode_mma import MMA_AUTO_MIN_CONTEXT, mma_launch

# Threadgroup memory budget of one decode threadgroup (Metal allows 32 KiB in all).
SHARED_BUDGET = 28 * 1024
# Enough threadgroups to fill a large GPU (132 SMs on an H200) a few times over; on the H200
# larger tiles measured faster at 128k even with fewer groups (docs/decode_kernels.md).
TARGET_GROUPS = 512


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


# (threads per group, keys per thread) in order of preference; the first that fits and gives
# TARGET_GROUPS groups wins.
TILINGS = ((256, 4), (256, 2), (256, 1), (128, 1), (64, 1))


def decode_plan(
    quant: LayerQuant,
    group: int,
    rows: int,
    head_dim: int,
    n_seq_heads: int,
    end: int,
    *,
    scale: float = 1.0,
    has_starts: bool = False,
    tilings=None,
    skip_v: bool = False,
    commit_rows: int = 1,
) -> dict | None:
    """Template values and launch shape for one decode call (rows = M query rows per head),
    or None when that many rows do not fit threadgroup memory. commit_rows: row r reads the
    code slots below the whole blocks of commit_rows in position + r + 1 (a protected layer's
    `TurboQuantConfig.committed_end`).

    Picks the threads per group NT and keys per thread TT: as many keys per group
    as threadgroup memory allows while still giving ~TARGET_GROUPS groups.
    """
    R = group * rows
    RP = -(-R // 4) * 4
    D = head_dim
    plan = None
    for NT, TT in tilings or TILINGS:
        if NT < D // 8 or NT < RP:
            continue
        shared = 4 * (D * RP + NT * TT * RP + (NT // 32) * RP + RP) + 4 * (2**quant.k.bits + 2**quant.v.bits)
        if shared > SHARED_BUDGET or TT * (3 if quant.k.bits == 3 else quant.k.bits) > 32:
            continue
        tiles = -(-end // (NT * TT))
        plan = (NT, TT, tiles)
        if n_seq_heads * tiles >= TARGET_GROUPS:
            break
    if plan is None:
        return None
    NT, TT, tiles = plan
    KW, VW = quant.k.words, quant.v.words
    kvec = 4 if KW % 4 == 0 else 2 if KW % 2 == 0 else 1
    return dict(
        template=[
            ("D", D),
            ("KB", quant.k.bits),
            ("VB", quant.v.bits),
            ("KW", KW),
            ("VW", VW),
            ("KVEC", kvec),
            ("G", group),
            ("M", rows),
            ("R", R),
            ("RP", RP),
            ("NT", NT),
            ("TT", TT),
            ("NS", min(32, _pow2_floor(NT // (D // 8)))),
            ("RV", 8 if RP % 8 == 0 else 4),
            ("KROT", rotation_arg(quant.k)[0]),
            ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale))[0]),
            ("HAS_STARTS", has_starts),
            ("SKIP_V", skip_v),
            ("CB", commit_rows),
        ],
        NT=NT,
        tiles=tiles,
        RP=RP,
        R=R,
    )


def tq_decode_unsupported(quant: LayerQuant, group: int, head_dim: int) -> str | None:
    """Why the decode kernels cannot serve this layer shape, or None."""
    for side, what in ((quant.k, "K"), (quant.v, "V")):
        reason = bits_reason(side, what)
        if reason:
            return reason
    if head_dim % 32:
        return f"head_dim {head_dim} is not a multiple of 32"
    if head_dim > 512:
        return f"head_dim {head_dim} is above 512"
    if decode_plan(quant, group, 1, head_dim, 1, 1) is None:
        return f"{group} query heads per KV head at head_dim {head_dim} do not fit threadgroup memory"
    return None


def _rows_per_call(quant: LayerQuant, group: int, head_dim: int, m: int) -> int:
    """Query rows per kernel call so that the rows' queries fit threadgroup memory."""
    per = 1
    while per < m and decode_plan(quant, group, per + 1, head_dim, 1, 1) is not None:
        per += 1
    return per


def tq_decode_attention(
    queries: mx.array,
    k_codes: mx.array,
    k_norms: mx.array,
    v_codes: mx.array,
    v_norms: mx.array,
    quant: LayerQuant,
    *,
    scale: float,
    position: int,
    kv_start: int | mx.array = 0,
    sinks: mx.array | None = None,
    backend: str,
    variant: str = "auto",
    dense: tuple[mx.array, mx.array, mx.array] | None = None,
    key_mean: mx.array | None = None,
    commit_rows: int = 1,
    _tilings=None,
    _skip_v: bool = False,
    _tiles_per_warp: int | None = None,
) -> mx.array:
    """M query rows at positions [position, position + M) over a packed cache, causally.

    On CUDA the tensor-core kernel (`tq_decode_mma`) serves long contexts at the head
    dims where it measured faster (MMA_AUTO_*); the dialect kernels serve the rest and Metal.

    Args:
        queries: (B, Hq, M, D).
        k_codes, v_codes: (B, Hkv, cap, words) uint32 storage (the whole buffer:
            slots past position + M - 1 are never read).
        k_norms, v_norms: (B, Hkv, cap) float32.
        quant: the layer's K and V tables.
        kv_start: keys before it are ignored; int or (B,) int array.
        sinks: (Hq,) sink logits or None.
        backend: "metal" or "cuda".
        variant: "auto", "mma" (CUDA tensor cores; an error if it cannot serve the shape)
            or "dialect" (the one-source kernels, also used on Metal).
        dense: FP16 rows in the same softmax, (keys, values, mask) as in
            `quant.reference.tq_attention_ref`: their partial joins the dialect kernel's
            tiles before the reduce (the tensor-core kernel merges inside and takes none).
        key_mean: (B, Hkv, D) key mean of centred codes: q·mean joins their scores.
        commit_rows: a protected layer's commit block (`TurboQuantConfig.commit_rows`): row r
            reads the code slots below commit_rows * floor((position + r + 1) / commit_rows)
            instead of those up to position + r.
        _tilings, _skip_v: benchmark knobs of the dialect kernels (tiling order; leave the
            V stage out); _tiles_per_warp: the tensor-core kernel's keys per warp / 16.
    Returns:
        (B, Hq, M, D) in the queries' dtype.
    """
    if variant not in ("auto", "mma", "dialect"):
        raise ValueError(f"unknown decode kernel variant {variant!r}; valid: auto, mma, dialect")
    M = queries.shape[2]
    if dense is not None or key_mean is not None:
        if variant == "mma":
            raise _backend.KernelUnsupported("tensor-core decode does not read FP16 rows or a key mean")
        variant = "dialect"
    if backend == "cuda" and (variant == "mma" or (variant == "auto" and position + M >= MMA_AUTO_MIN_CONTEXT)):
        # Every layer's decode step comes here: one cached launch per call shape keeps the
        # Python on the way short (host build, not the GPU, bounds a call at 128k).
        mma = mma_launch(
            quant, queries, k_codes.shape[1], scale, isinstance(kv_start, mx.array), sinks is not None,
            commit_rows=commit_rows,
        )
        if mma.reason is None and (variant == "mma" or mma.auto):
            return mma(queries, k_codes, k_norms, v_codes, v_norms, position, kv_start, sinks, _tiles_per_warp)
        if variant == "mma":
            raise _backend.KernelUnsupported(f"tensor-core decode cannot serve this: {mma.reason}")
    elif variant == "mma":
        raise _backend.KernelUnsupported(f"tensor-core decode runs on CUDA only, not {backend!r}")
    B, Hq, _, D = queries.shape
    Hkv = k_codes.shape[1]
    G = Hq // Hkv
    per = _rows_per_call(quant, G, D, M)
    if per < M:  # too many query rows for one call's threadgroup memory: split them
        parts = []
        for m0 in range(0, M, per):
            parts.append(
                tq_decode_attention(
                    queries[:, :, m0 : m0 + per],
                    k_codes,
                    k_norms,
                    v_codes,
                    v_norms,
                    quant,
                    scale=scale,
                    position=position + m0,
                    kv_start=kv_start,
                    sinks=sinks,
                    backend=backend,
                    variant="dialect",
                    dense=None if dense is None else (dense[0], dense[1], dense[2][:, :, m0 : m0 + per]),
                    key_mean=key_mean,
                    commit_rows=commit_rows,
                )
            )
        return mx.concatenate(parts, axis=2)

    end = position + M
    has_starts = isinstance(kv_start, mx.array)
    plan = decode_plan(
        quant,
        G,
        M,
        D,
        B * Hkv,
        end,
        scale=scale,
        has_starts=has_starts,
        tilings=_tilings,
        skip_v=_skip_v,
        commit_rows=commit_rows,
    )
    tiles, NT, R, RP = plan["tiles"], plan["NT"], plan["R"], plan["RP"]
    part_o, part_ms = launch(
        "tq_decode_attention",
        backend,
        plan["template"],
        inputs=[
            queries,
            k_codes,
            k_norms,
            v_codes,
            v_norms,
            padded_table(quant.k, "centroids"),
            padded_table(quant.v, "centroids"),
            rotation_arg(quant.k)[1],
            *step_args(position, kv_start, B),
        ],
        grid=(NT * tiles, B * Hkv, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hkv, tiles, R, D), (B, Hkv, tiles, RP, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    if key_mean is not None:  # scores of centred codes lack q·mean: shift each row's max by it
        offset = scale * (queries.astype(mx.float32).reshape(B, Hkv, G, M, D) @ key_mean[:, :, None, :, None])
        offset = mx.pad(offset.reshape(B, Hkv, 1, R, 1), [(0, 0), (0, 0), (0, 0), (0, RP - R), (0, 0)])
        part_ms = part_ms + mx.concatenate([offset, mx.zeros_like(offset)], axis=-1)
    if dense is not None:
        dense_o, dense_ms = _dense_partial(queries, *dense, quant, scale, RP)
        part_o = mx.concatenate([part_o, dense_o], axis=2)
        part_ms = mx.concatenate([part_ms, dense_ms], axis=2)
    has_sink = sinks is not None
    sink_arr = sinks_arg(sinks)
    tsl = max(1, min(8, 1024 // D))
    vrot_kind, vrot = rotation_arg(quant.v)
    (out,) = launch(
        "tq_decode_reduce",
        backend,
        [
            ("D", D),
            ("G", G),
            ("M", M),
            ("R", R),
            ("RP", RP),
            ("TSL", tsl),
            ("HAS_SINK", has_sink),
            ("VROT", vrot_kind),
            ("OT", queries.dtype),
        ],
        inputs=[part_o, part_ms, sink_arr, vrot],
        grid=(D * tsl * B * Hq * M, 1, 1),
        threadgroup=(D * tsl, 1, 1),
        output_shapes=[(B, Hq, M, D)],
        output_dtypes=[queries.dtype],
    )
    return out


def _dense_partial(queries, keys, values, mask, quant: LayerQuant, scale: float, RP: int):
    """One more tile for the reduce: the FP16 rows' partial in the kernel's layout
    (part_o (B, Hkv, 1, R, D) in Π_V space; part_ms (B, Hkv, 1, RP, 2))."""
    B, Hq, M, D = queries.shape
    Hkv, R = keys.shape[1], Hq // keys.shape[1] * M
    m, l, o = fp16_rows_partial_ref(queries, keys, values, mask, quant, scale)
    ms = mx.concatenate([m, l], axis=-1).reshape(B, Hkv, 1, R, 2)
    pad = mx.broadcast_to(mx.array([-mx.inf, 0.0]), (B, Hkv, 1, RP - R, 2))
    return o.reshape(B, Hkv, 1, R, D), mx.concatenate([ms, pad], axis=3)
