"""TurboQuant hot paths on the GPU kernels, with their `_ref` beside them.

* `tq_quantize(x, side)`: the commit's quantize step (rotate, norms, Lloyd-Max
  cell, pack) -> `kernels/tq_quantize.kernel`; `quantize_ref` is its oracle.
* `tq_decode_attention(...)`: M query rows over a packed cache ->
  `kernels/tq_decode_attention.kernel` (flash-decoding tiles) +
  `kernels/tq_decode_reduce.kernel`; `attention.tq_attention_ref` is its oracle.
  The query is rotated once per threadgroup inside pass 1 (a Hadamard butterfly
  or a dense product in threadgroup memory) and the output rotated back once per
  row inside the reduce, so one decode call is two kernel launches: on MLX CUDA
  every extra op costs tens of microseconds of host time, more than the kernels at 4k.

`*_unsupported` say why a kernel cannot serve a configuration (None: it can);
`backend.resolve` turns that into an error or a warned fallback, never a silent one.
"""

from __future__ import annotations

import struct
import weakref
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import backend as _backend
from .kernel_build import cuda_kernel, launch
from .quant.packing import PLANES
from .quant.turboquant import LayerQuant, SideQuant, quantize_ref

# Threadgroup memory budget of one decode threadgroup (Metal allows 32 KiB in all).
SHARED_BUDGET = 28 * 1024
# Enough threadgroups to fill a large GPU (132 SMs on an H200) a few times over; on the H200
# larger tiles measured faster at 128k even with fewer groups (benchmarks/results notes).
TARGET_GROUPS = 512

_ZEROS8 = mx.zeros((8,), mx.float32)
_ZEROS8_I32 = mx.zeros((8,), mx.int32)
_tables: "weakref.WeakKeyDictionary[SideQuant, dict[str, mx.array]]" = weakref.WeakKeyDictionary()


def _resident(a: mx.array) -> mx.array:
    """A copy of `a` made by an op, evaluated. On MLX CUDA an array built from host data
    lives in managed memory, which a kernel reads through page faults or over PCIe; an
    op's output lives in device memory. (`a` stays referenced, so MLX cannot donate its
    buffer to the copy.)"""
    b = a + 0
    mx.eval(b)
    return b


def _padded(side: SideQuant, name: str) -> mx.array:
    """side.centroids / side.boundaries padded to >= 8 entries, so Metal always passes them in
    `device` space (MLX puts inputs of < 8 elements in `constant` space: another signature)."""
    cache = _tables.setdefault(side, {})
    if name not in cache:
        a = getattr(side, name).astype(mx.float32)
        if a.size < 8:
            a = mx.concatenate([a, mx.zeros((8 - a.size,), mx.float32)])
        cache[name] = _resident(a)
    return cache[name]


def _rotation(side: SideQuant) -> tuple[int, mx.array]:
    """(ROT template value, array) for a side: 0 and the (D,) signs of a randomized
    Hadamard, or 1 and the (D, D) dense Π. The kernels apply it in float32."""
    cache = _tables.setdefault(side, {})
    if "rot" not in cache:
        r = side.rotation
        arr = r.signs if r.kind == "hadamard" else r.matrix
        cache["rot"] = (0 if r.kind == "hadamard" else 1, _resident(arr.astype(mx.float32)))
    return cache["rot"]


def _bits_reason(side: SideQuant, what: str) -> str | None:
    if side.bits not in PLANES:
        return f"{what} bits {side.bits} have no kernel (kernels cover {sorted(PLANES)})"
    return None


_LENGTHS = [mx.zeros((1 << 16,), mx.uint8)]
_LENGTH_VIEWS: dict[int, mx.array] = {}


def _length_arg(n: int) -> mx.array:
    """An array of n + 1 bytes, a prefix view of one buffer: how a per-step integer (the
    query position, kv_start) reaches a kernel, which reads it from `<input>_shape`, a
    launch parameter. A host-made mx.array lands in MLX CUDA's managed memory: in ncu on
    the H200 the decode kernel's first read of one stalled its warps (37% of the stall
    samples at 4k keys). The buffer's bytes are never read, so nothing is copied or moved.
    Views are kept per n, so the layers of one decode step share one (a slice costs ~1.4 us
    of host time)."""
    view = _LENGTH_VIEWS.get(n)
    if view is None:
        buf = _LENGTHS[0]
        if buf.size <= n:
            buf = _LENGTHS[0] = mx.zeros((max(n + 1, 2 * buf.size),), mx.uint8)
        if len(_LENGTH_VIEWS) >= 64:  # positions only grow: older views are done with
            _LENGTH_VIEWS.clear()
        view = _LENGTH_VIEWS[n] = buf[: n + 1]
    return view


def _step_args(position: int, kv_start: int | mx.array, batch: int) -> list[mx.array]:
    """The decode kernels' per-step inputs (qpos, kv0, kv_starts): the first query position
    and an int kv_start as lengths, per-sequence starts as a >= 8-element int32 array
    (unused zeros for an int start)."""
    if not isinstance(kv_start, mx.array):
        return [_length_arg(position), _length_arg(int(kv_start)), _ZEROS8_I32]
    starts = mx.broadcast_to(kv_start.astype(mx.int32).reshape(-1), (batch,))
    if batch < 8:
        starts = mx.concatenate([starts, mx.zeros((8 - batch,), mx.int32)])
    return [_length_arg(position), _length_arg(0), starts]


# tq_decode_mma's scratch: per (b, KV head) a ticket word, zero between launches (each
# launch's last blocks leave theirs at zero), then the blocks' partials. One scratch per
# output dtype serves every launch of that dtype, so no two of them may run at once, and a
# CUDA graph runs nodes without a data dependency concurrently: each launch takes the last
# one's output as an input (`after`, never read), a dependency MLX sees and keeps in order.
# (A partials output instead cost ~1.2 us of host build and ~1.8 of encode per call, session
# 9; a ring of regions handed out in call order was only as safe as its length.)
MMA_TICKET_WORDS = 65536  # > B * Hkv, the grid's y (CUDA caps it at 65535)
_MMA_CHAIN: dict = {}  # output dtype -> [scratch, the last launch's output]


def _mma_chain(dtype: mx.Dtype, part_words: int) -> list:
    """[scratch, last output] of `dtype`'s launches, the scratch grown to hold part_words
    of partials (a grown one is zeroed; launches in flight keep the old one alive)."""
    state = _MMA_CHAIN.get(dtype)
    if state is None or state[0].size < MMA_TICKET_WORDS + part_words:
        scratch = _resident(mx.zeros((MMA_TICKET_WORDS + 2 * part_words,), mx.uint32))
        after = state[1] if state is not None else _resident(mx.zeros((1,), dtype))
        state = _MMA_CHAIN[dtype] = [scratch, after]
    return state


def _sinks_arg(sinks: mx.array | None) -> mx.array:
    """Sink logits as a >= 8-element float32 array (unused zeros without sinks)."""
    if sinks is None:
        return _ZEROS8
    a = sinks.astype(mx.float32)
    return mx.concatenate([a, mx.zeros((8 - a.size,), mx.float32)]) if a.size < 8 else a


# -- commit: quantize M rows ------------------------------------------------


def tq_quantize_unsupported(x: mx.array, side: SideQuant) -> str | None:
    """Why the quantize kernel cannot serve these rows, or None."""
    if x.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"rows of dtype {x.dtype} (kernels take float16, bfloat16, float32)"
    return _bits_reason(side, "code")


def tq_quantize(x: mx.array, side: SideQuant, backend: str | None = None) -> tuple[mx.array, mx.array]:
    """(..., d) rows -> ((..., words) uint32 codes, (...,) float32 norms), as `quantize_ref`.

    On a kernel backend the codes equal `quantize_ref`'s except where a rotated
    coordinate lies within float32 rounding of a cell boundary (the kernel rotates
    x in its own order of operations and then divides by ||x||).
    """
    if backend is None:
        backend = _backend.resolve(tq_quantize_unsupported(x, side))
    if backend == "reference":
        return quantize_ref(x, side)
    lead = x.shape[:-1]
    d = x.shape[-1]
    rows = 1
    for n in lead:
        rows *= n
    rot_kind, rot = _rotation(side)
    codes, norms = launch(
        "tq_quantize",
        backend,
        [("T", x.dtype), ("D", d), ("BITS", side.bits), ("W", side.words), ("ROT", rot_kind)],
        inputs=[x.reshape(rows, d), rot, _padded(side, "boundaries")],
        grid=(32 * rows, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(rows, side.words), (rows,)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return codes.reshape(*lead, side.words), norms.reshape(lead)


# -- decode attention ---------------------------------------------------------


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


# (threads per group, keys per thread) tried in order; the first that fits and gives
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
) -> dict | None:
    """Template values and launch shape for one decode call (rows = M query rows per head),
    or None when that many rows do not fit threadgroup memory.

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
            ("KROT", _rotation(quant.k)[0]),
            ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale))[0]),
            ("HAS_STARTS", has_starts),
            ("SKIP_V", skip_v),
        ],
        NT=NT,
        tiles=tiles,
        RP=RP,
        R=R,
    )


def tq_decode_unsupported(quant: LayerQuant, group: int, head_dim: int) -> str | None:
    """Why the decode kernels cannot serve this layer shape, or None."""
    for side, what in ((quant.k, "K"), (quant.v, "V")):
        reason = _bits_reason(side, what)
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
        _tilings, _skip_v: benchmark knobs of the dialect kernels (tiling order; leave the
            V stage out); _tiles_per_warp: the tensor-core kernel's keys per warp / 16.
    Returns:
        (B, Hq, M, D) in the queries' dtype.
    """
    if variant not in ("auto", "mma", "dialect"):
        raise ValueError(f"unknown decode kernel variant {variant!r}; valid: auto, mma, dialect")
    M = queries.shape[2]
    if backend == "cuda" and (variant == "mma" or (variant == "auto" and position + M >= MMA_AUTO_MIN_CONTEXT)):
        # Every layer's decode step comes here: one cached launch per call shape, so the
        # Python on the way stays short (session 12: ~3.5 us of a call's ~8.5 us of host
        # build on the H200 was this wrapper).
        mma = _mma_launch(quant, queries, k_codes.shape[1], scale, isinstance(kv_start, mx.array), sinks is not None)
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
        return _split_rows(
            tq_decode_attention,
            per,
            queries,
            k_codes,
            k_norms,
            v_codes,
            v_norms,
            quant,
            scale=scale,
            position=position,
            kv_start=kv_start,
            sinks=sinks,
            backend=backend,
            variant="dialect",
        )

    end = position + M
    cap = k_codes.shape[2]
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
            _padded(quant.k, "centroids"),
            _padded(quant.v, "centroids"),
            _rotation(quant.k)[1],
            *_step_args(position, kv_start, B),
        ],
        grid=(NT * tiles, B * Hkv, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hkv, tiles, R, D), (B, Hkv, tiles, RP, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    has_sink = sinks is not None
    sink_arr = _sinks_arg(sinks)
    tsl = max(1, min(8, 1024 // D))
    vrot_kind, vrot = _rotation(quant.v)
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


# -- decode attention on tensor cores (CUDA) ---------------------------------

# What tq_decode_mma.kernel serves; other shapes take the dialect kernels above.
MMA_HEAD_DIMS = (64, 128, 256)
MMA_BITS = (2, 3, 4, 8)
MMA_MAX_ROWS = 16  # query rows (G * M) of one KV head per call: one m16 score tile
# Warps per block. 8 (one table fill serves twice the tiles, 4 warps per scheduler at 2
# blocks per SM) measured faster than 4 on the H200 (session 6, tq4, chained calls incl.
# host time: 105 vs 113 us at 128k, 59 vs 65 at 32k; kernel alone in ncu 75 vs 84 at 128k).
MMA_WARPS = 8
# 16-key tiles per warp, at least: each block pays a table fill and a partial to merge.
# On the H200 at 4k (8 warps), 2 measured 36.6 us, 4 37.1 and 8 41.8 (more blocks in flight).
MMA_MIN_TILES = 2
MMA_SMS = 132  # an H200's SMs
# Per-SM resources of sm_90 (H100 / H200): registers, shared memory, and what each block
# reserves of it; they bound the resident blocks of a variant.
MMA_SM_REGS = 65536
MMA_SM_SHARED = 228 * 1024
MMA_BLOCK_SHARED_RESERVED = 1024
# Blocks per SM the split count aims at, at most: on the H200 at 128k with 4 warps per
# block, 2 (32 splits per KV head) beat one full wave of 4 (166 vs 188 us for tq4; fewer
# partials to merge, fewer table fills); 8-warp blocks fit 2 per SM by registers anyway.
MMA_BLOCKS_PER_SM = 2
# What the automatic choice sends to the tensor-core kernel, from the H200 measurements: at
# D 128 it is as fast as or faster than the dialect kernels from 4k keys on (session 3,
# benchmarks/results/decode_attention_mma_sweep.md); since session 7 (one-barrier set-up) also
# at D 256, where it had been slower: gemma-like shape (Hq 4, Hkv 1), chained calls, tq4
# 44 / 53 / 58 us vs 76 / 77 / 96 at 4k / 32k / 128k, tq3 and k8v4 alike
# (benchmarks/results/decode_attention_s7_run1.md). Below 4k keys the dialect kernels serve.
MMA_AUTO_HEAD_DIMS = (64, 128, 256)
MMA_AUTO_MIN_CONTEXT = 4096
MMA_MAX_SPLITS = 1024
# Lookup addresses by one PRMT (tq_decode_mma.kernel, PL) where a variant allows it.
# H200, session 8 (chained probe, tq4 llama shape): 128k 85.6 -> 75.8 us per call, 32k
# 44.5 -> 39.1, 4k unchanged (benchmarks/results/mma_probe_s8_prmt.json). Session 9, 2/3
# bits (pair indices assembled as bytes), tq3: 128k 95.3 -> 77.0 us eval per call, 32k
# 48.5 -> 38.7, 4k unchanged (mma_probe_s9_tq3_pl.json); K and V tables side by side, k8v4:
# 128k 136.8 -> 128.1, 4k-32k unchanged (mma_probe_s9_k8v4_pl.json).
MMA_PRMT_LOOKUPS = True
# Shared memory for the warps' rings of in-flight tiles: cp.async keeps the bytes in flight
# out of registers. With 8 warps, 48 KB is 2 slots of 2.4 KB per warp at tq4, D 128 (one
# tile in flight while one is worked on); 3 or 4 slots measured the same on the H200.
MMA_RING_BYTES = 48 * 1024
MMA_MAX_STAGES = 4

_LOG2E = 1.4426950408889634


def _lut_entries(bits: int) -> int:
    return 256 if bits == 8 else 1 << (2 * bits)


def _mma_lut(side: SideQuant) -> mx.array:
    """The side's lookup table for tq_decode_mma: centroids * sqrt(d) in float16, one
    half2 per pair of codes for 2/3/4 bits (the pair's bits as the packing lays them
    out: plane 0 bits of both coordinates, then the high plane's for 3 bits), one half
    per code for 8 bits."""
    cache = _tables.setdefault(side, {})
    if "mma_lut" not in cache:
        c = (np.asarray(side.centroids, dtype=np.float64) * side.head_dim**0.5).astype(np.float16)
        h = c.view(np.uint16).astype(np.uint32)
        b = side.bits
        if b == 8:
            table = h
        else:
            e = np.arange(1 << (2 * b), dtype=np.uint32)
            if b == 3:
                lo, hi = e & 15, e >> 4
                first = (lo & 3) | ((hi & 1) << 2)
                second = (lo >> 2) | ((hi >> 1) << 2)
            else:
                first, second = e & ((1 << b) - 1), e >> b
            table = h[first] | (h[second] << 16)
        cache["mma_lut"] = _resident(mx.array(table.astype(np.uint32)))
    return cache["mma_lut"]


def _same_codebook(quant: LayerQuant) -> bool:
    """K and V share one table when their codebooks are equal: a Lloyd-Max codebook is a
    function of (bits, d) alone (quant.codebook.lloyd_max_codebook)."""
    return quant.k.bits == quant.v.bits and quant.k.head_dim == quant.v.head_dim


def tq_mma_unsupported(quant: LayerQuant, group: int, rows: int, head_dim: int) -> str | None:
    """Why tq_decode_mma cannot serve this call shape, or None."""
    if head_dim not in MMA_HEAD_DIMS:
        return f"head_dim {head_dim} (tensor-core decode covers {MMA_HEAD_DIMS})"
    for side, what in ((quant.k, "K"), (quant.v, "V")):
        if side.bits not in MMA_BITS:
            return f"{what} bits {side.bits} (tensor-core decode covers {MMA_BITS})"
    if group > MMA_MAX_ROWS:
        return f"{group} query heads per KV head (tensor-core decode takes <= {MMA_MAX_ROWS})"
    return None


class MmaConfig(NamedTuple):
    """What one call shape of tq_decode_mma needs besides the split count."""

    template: tuple
    smem: int  # dynamic shared memory, bytes
    R: int  # query rows of one KV head
    RP: int  # R rounded up to 8
    nwarp: int
    per_sm: int  # resident blocks per SM (registers, shared memory)
    tables: list  # [one uint32 array: K table, V table, Π_K, Π_V] (_mma_tables)
    kernel: list  # [the MLX kernel object], filled on the first launch (needs the CUDA backend)


def _mma_config(
    quant: LayerQuant,
    group: int,
    rows: int,
    head_dim: int,
    scale: float,
    has_starts: bool,
    has_sink: bool,
    out_dtype: mx.Dtype,
) -> MmaConfig:
    """The MmaConfig of a call shape, cached beside the K tables: a decode step only adds
    the split count (the kernel derives keys per warp from it)."""
    cache = _tables.get(quant.k) or _tables.setdefault(quant.k, {})
    key = (
        "mma",
        quant.v.bits,
        quant.v.rotation.kind,
        group,
        rows,
        head_dim,
        scale,
        has_starts,
        has_sink,
        out_dtype,
    )
    cfg = cache.get(key)
    if cfg is None:
        cfg = cache[key] = _mma_config_uncached(
            quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype
        )
    return cfg


def _mma_regs(quant: LayerQuant, head_dim: int, RP: int) -> int:
    """Registers per thread a variant wants (sm_90, tests' nvcc compile): ~128 for 2/3/4-bit K
    at D <= 128 with 8 rows, up to ~168 with 8-bit K or 16 rows, more at D 256. Only variants
    at <= 128 get 16 warps; every build is bounded to its block size anyway
    (kernel_build._cuda_launch_bounds), so this chooses speed (no spills), not launchability."""
    if head_dim <= 128:
        return 128 if (RP == 8 and quant.k.bits != 8) else 168
    return 255


def _mma_tables(quant: LayerQuant) -> tuple[mx.array, dict[str, int]]:
    """The K table, the V table, Π_K and Π_V (float32 bits) as one uint32 array, and the word
    offsets of the last three (template values): each input of a custom-kernel call costs
    host time at every step (~0.15 us to build, as much to encode, on the H200 host)."""
    parts = [_mma_lut(quant.k), _mma_lut(quant.v), _rotation(quant.k)[1], _rotation(quant.v)[1]]
    at = np.cumsum([0] + [a.size for a in parts[:-1]]).tolist()
    merged = _resident(mx.concatenate([a.reshape(-1).view(mx.uint32) for a in parts]))
    return merged, {"VTAB_AT": at[1], "KROT_AT": at[2], "VROT_AT": at[3]}


def _mma_config_uncached(quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype):
    tables, offsets = _mma_tables(quant)
    R = group * rows
    RP = 8 if R <= 8 else 16
    D = head_dim
    KE, VE = _lut_entries(quant.k.bits), _lut_entries(quant.v.bits)
    shared_table = _same_codebook(quant)
    vlut_off = 0 if shared_table else 32 * KE
    lut_words = 32 * KE + (0 if shared_table else 32 * VE)
    v_stride = quant.v.words + (4 if quant.v.words % 8 == 0 else 0)  # VRWP in the kernel
    tile_words = 16 * (quant.k.words + v_stride) + 32
    # PL: byte-indexed tables (a pair of 2/3/4-bit codes or one 8-bit code per byte) at
    # shared-window address 64 KB, entries 256 bytes apart, K's and V's side by side (see the
    # kernel): up to ~210 KB per block, so one block per SM; of 16 warps where ptxas gives the
    # variant <= 128 registers (16 x 32 x 128 is the register file), else of 8.
    def layout(pl: bool) -> tuple[int, int, int]:
        """(warps per block, ring slots per warp, shared memory bytes) with or without PL."""
        wide = _mma_regs(quant, head_dim, RP) * 32 * 2 * MMA_WARPS <= MMA_SM_REGS
        nwarp = 2 * MMA_WARPS if pl and wide else MMA_WARPS
        # Each warp's ring of tiles (K rows, V rows, norms of 16 keys): as many slots as fit in
        # MMA_RING_BYTES, 2 to 4 (2 is one tile in flight while one is worked on).
        stages = max(2, min(MMA_MAX_STAGES, MMA_RING_BYTES // (4 * nwarp * tile_words)))
        ring_words = nwarp * stages * tile_words
        # Set-up and main loop: tables, q', row factors, rings (128-byte aligned: up to 32 words
        # skipped); then the warps' merge buffers (R rows padded to D + 12 words: WS in the
        # kernel), which reuse the same memory. Under PL: 64 KB below the table (whatever the
        # window's base; the merge buffers go there when they fit), the table, then q', rows, rings.
        # (a 3-bit table is stored four times over under PL: 256 entries, see the kernel)
        pl_entries = max(256 if b == 3 else _lut_entries(b) for b in (quant.k.bits, quant.v.bits))
        tables_words = 16384 + 64 * pl_entries if pl else lut_words
        smem = 4 * max(tables_words + D * RP + RP + 32 + ring_words, nwarp * (R * (D + 12) + 2 * RP))
        return nwarp, stages, smem

    pl = MMA_PRMT_LOOKUPS
    nwarp, stages, smem = layout(pl)
    if pl and smem > MMA_SM_SHARED - MMA_BLOCK_SHARED_RESERVED:  # e.g. an 8-bit table at 16 warps
        pl = False
        nwarp, stages, smem = layout(pl)
    per_sm = max(
        1,
        min(
            MMA_SM_REGS // (_mma_regs(quant, D, RP) * 32 * nwarp),
            MMA_SM_SHARED // (smem + MMA_BLOCK_SHARED_RESERVED),
        ),
    )
    template = (
        ("D", D),
        ("KB", quant.k.bits),
        ("VB", quant.v.bits),
        ("G", group),
        ("M", rows),
        ("R", R),
        ("RP", RP),
        ("NWARP", nwarp),
        ("STAGES", stages),
        ("KROT", _rotation(quant.k)[0]),
        ("VROT", _rotation(quant.v)[0]),
        ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale * _LOG2E))[0]),
        ("HAS_STARTS", has_starts),
        ("HAS_SINK", has_sink),
        ("VLUT_OFF", vlut_off),
        ("PL", pl),
        *offsets.items(),
        ("TICKET_WORDS", MMA_TICKET_WORDS),
        ("OT", out_dtype),
    )
    return MmaConfig(template, smem, R, RP, nwarp, per_sm, [tables], [])


def _mma_splits(cfg: MmaConfig, tiles: int, n_seq_heads: int, tiles_per_warp: int | None = None) -> int:
    """Splits per (b, KV head): one wave of resident blocks (at most MMA_BLOCKS_PER_SM per SM)
    over all (b, KV head), at least MMA_MIN_TILES 16-key tiles per warp (the tables cost each
    block a fill), at most MMA_MAX_SPLITS splits."""
    if tiles_per_warp is None:
        per_head = max(1, MMA_SMS * min(cfg.per_sm, MMA_BLOCKS_PER_SM) // n_seq_heads)
        tiles_per_warp = max(
            max(1, MMA_MIN_TILES * MMA_WARPS // cfg.nwarp),  # keys per block, not per warp
            -(-tiles // (cfg.nwarp * per_head)),
            -(-tiles // (cfg.nwarp * MMA_MAX_SPLITS)),
        )
    return -(-tiles // (cfg.nwarp * tiles_per_warp))


def mma_plan(
    quant: LayerQuant,
    group: int,
    rows: int,
    head_dim: int,
    n_seq_heads: int,
    end: int,
    *,
    scale: float,
    has_starts: bool,
    has_sink: bool,
    out_dtype: mx.Dtype,
    tiles_per_warp: int | None = None,
) -> dict:
    """Template values, launch shape and shared memory of one tq_decode_mma call."""
    cfg = _mma_config(quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype)
    tiles = -(-end // 16)
    splits = _mma_splits(cfg, tiles, n_seq_heads, tiles_per_warp)
    return dict(
        template=cfg.template,
        splits=splits,
        smem=cfg.smem,
        R=cfg.R,
        RP=cfg.RP,
        nwarp=cfg.nwarp,
        tiles_per_warp=-(-tiles // (cfg.nwarp * splits)),
        tables=cfg.tables,
    )


def _split_rows(fn, per: int, queries: mx.array, *args, position: int, **kwargs) -> mx.array:
    """`fn` over query rows [m0, m0 + per) (at positions position + m0), concatenated: for
    calls with more rows than one launch takes."""
    parts = [
        fn(queries[:, :, m0 : m0 + per], *args, position=position + m0, **kwargs)
        for m0 in range(0, queries.shape[2], per)
    ]
    return mx.concatenate(parts, axis=2)


def tq_decode_mma(
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
    _tiles_per_warp: int | None = None,
) -> mx.array:
    """`tq_decode_attention` on CUDA tensor cores, in one launch (see tq_decode_mma.kernel).

    fp16 operands with fp32 accumulation: q'/||q'||, centroids and softmax weights are
    rounded to fp16 (relative 2^-11), so the output matches the fp32 reference to ~1e-3
    relative, far below the 4-bit quantization error it sits on.

    This runs once per layer and decode step, so everything but the split count is cached
    per call shape (_MmaLaunch).
    """
    launch = _mma_launch(quant, queries, k_codes.shape[1], scale, isinstance(kv_start, mx.array), sinks is not None)
    if launch.reason is not None:
        raise _backend.KernelUnsupported(f"tensor-core decode cannot serve this: {launch.reason}")
    return launch(queries, k_codes, k_norms, v_codes, v_norms, position, kv_start, sinks, _tiles_per_warp)


class _MmaLaunch:
    """What a tq_decode_mma call shape (quant, query shape and dtype, KV heads, scale, starts,
    sinks) needs at every step, and its launch shape per 16-key tile count: host time per
    call is what bounds decode, and a decode step repeats one shape per layer. `reason`: why
    the kernel cannot serve the shape (then the rest is unset), or None."""

    def __init__(self, quant: LayerQuant, queries: mx.array, Hkv: int, scale, has_starts, has_sink):
        B, Hq, M, D = queries.shape
        G = Hq // Hkv
        self.reason = tq_mma_unsupported(quant, G, M, D)
        self.rows = M
        # The automatic choice (tq_decode_attention) takes this kernel at this head dim (from
        # MMA_AUTO_MIN_CONTEXT keys on).
        self.auto = D in MMA_AUTO_HEAD_DIMS
        if self.reason is not None:
            return
        self.quant, self.scale = quant, scale
        self.per = max(1, MMA_MAX_ROWS // G)  # query rows one launch takes
        self.batch = B
        self.n_seq_heads = B * Hkv
        self.by_tiles: dict[int, tuple] = {}
        self._kernel = None
        if self.per < M:  # launches of `per` rows each (_split_rows), each its own shape
            return
        self.cfg = _mma_config(quant, G, M, D, scale, has_starts, has_sink, queries.dtype)
        self.tables = self.cfg.tables[0]
        self.part_words = self.cfg.R * D + 2 * self.cfg.RP  # one partial (tq_decode_mma.kernel)
        self.threadgroup = (32 * self.cfg.nwarp, 1, 1)
        self.dtype = queries.dtype
        self.output_shapes = [(B, Hq, M, D)]
        self.output_dtypes = [queries.dtype]

    def __call__(self, queries, k_codes, k_norms, v_codes, v_norms, position, kv_start, sinks, tiles_per_warp=None):
        if self.per < self.rows:
            return _split_rows(
                tq_decode_mma,
                self.per,
                queries,
                k_codes,
                k_norms,
                v_codes,
                v_norms,
                self.quant,
                scale=self.scale,
                position=position,
                kv_start=kv_start,
                sinks=sinks,
                _tiles_per_warp=tiles_per_warp,
            )
        tiles = (position + self.rows + 15) // 16
        shape = self.by_tiles.get(tiles) if tiles_per_warp is None else None
        if shape is None:
            shape = self.shape(tiles, tiles_per_warp)
        grid, part_words = shape
        chain = _mma_chain(self.dtype, part_words)
        out = (self._kernel or self.kernel)(
            inputs=[
                queries,
                # The codes as bytes: MLX CUDA puts kernels in one CUDA graph until their inputs
                # pass ~1000 M *elements*, and launches nothing before; counted as uint32 words,
                # 20 calls at 128k keys made one graph whose whole host encode the GPU waited for.
                k_codes.view(mx.uint8),
                k_norms,
                v_codes.view(mx.uint8),
                v_norms,
                self.tables,  # K table, V table, Π_K, Π_V
                _sinks_arg(sinks),
                *_step_args(position, kv_start, self.batch),
                *chain,  # scratch, after
            ],
            grid=grid,
            threadgroup=self.threadgroup,
            output_shapes=self.output_shapes,
            output_dtypes=self.output_dtypes,
        )[0]
        chain[1] = out
        return out

    @property
    def kernel(self):
        if self._kernel is None:  # built on first use: needs the CUDA backend
            if not self.cfg.kernel:
                self.cfg.kernel.append(cuda_kernel("tq_decode_mma", self.cfg.template, self.cfg.smem))
            self._kernel = self.cfg.kernel[0]
        return self._kernel

    def shape(self, tiles: int, tiles_per_warp: int | None = None) -> tuple:
        """(grid, words of partials) for this many tiles; kept unless tiles_per_warp is forced."""
        splits = _mma_splits(self.cfg, tiles, self.n_seq_heads, tiles_per_warp)
        shape = ((32 * self.cfg.nwarp * splits, self.n_seq_heads, 1), self.n_seq_heads * splits * self.part_words)
        if tiles_per_warp is None:
            if len(self.by_tiles) >= 4096:  # contexts only grow: older counts are done with
                self.by_tiles.clear()
            self.by_tiles[tiles] = shape
        return shape


def _mma_launch(quant: LayerQuant, queries: mx.array, Hkv: int, scale, has_starts, has_sink) -> _MmaLaunch:
    """The _MmaLaunch of a call shape, cached beside the K tables (dropped with the layer)."""
    cache = _tables.get(quant.k) or _tables.setdefault(quant.k, {})
    key = ("launch", quant.v, queries.shape, queries.dtype, Hkv, scale, has_starts, has_sink)
    launch = cache.get(key)
    if launch is None:
        launch = cache[key] = _MmaLaunch(quant, queries, Hkv, scale, has_starts, has_sink)
    return launch
