"""Decode attention on CUDA tensor cores: `kernels/tq_decode_mma.kernel`, one launch per call.

Score and weighted-V products run as `mma.sync` (fp16 operands, fp32 accumulation); tiles
of packed codes stream into shared memory with `cp.async`; code pairs are looked up in a
lane-replicated table; the last block of each (sequence, KV head) merges the splits. The
plan of a call shape (`MmaConfig`) and its launch (`MmaLaunch`) are built once and cached
beside the layer's tables, since host time per call is what bounds decode.
See docs/decode_kernels.md.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..quant.tables import LayerQuant, SideQuant
from . import backend as _backend
from .args import _ZEROS8, TABLES, resident, rotation_arg, sinks_arg, split_rows, step_args
from .build import LAUNCHES, cuda_kernel

# tq_decode_mma's scratch: per (b, KV head) a ticket word, zero between launches (each
# launch's last blocks leave theirs at zero), then the blocks' partials. One scratch per
# output dtype serves every launch of that dtype, so no two of them may run at once, and a
# CUDA graph runs nodes without a data dependency concurrently: each launch takes the last
# one's output as an input (`after`, never read), a dependency MLX sees and keeps in order.
# (A partials output per call costs ~1.2 us of host build and ~1.8 of encode on the H200;
# docs/decode_kernels.md.)
MMA_TICKET_WORDS = 65536  # > B * Hkv, the grid's y (CUDA caps it at 65535)
_MMA_CHAIN: dict = {}  # output dtype -> [scratch, the last launch's output]


def _mma_chain(dtype: mx.Dtype, part_words: int) -> list:
    """[scratch, last output] of `dtype`'s launches, the scratch grown to hold part_words
    of partials (a grown one is zeroed; launches in flight keep the old one alive)."""
    state = _MMA_CHAIN.get(dtype)
    if state is None or state[0].size < MMA_TICKET_WORDS + part_words:
        scratch = resident(mx.zeros((MMA_TICKET_WORDS + 2 * part_words,), mx.uint32))
        after = state[1] if state is not None else resident(mx.zeros((1,), dtype))
        state = _MMA_CHAIN[dtype] = [scratch, after]
    return state


# What tq_decode_mma.kernel serves; other shapes take the dialect kernels above.
MMA_HEAD_DIMS = (64, 128, 256)
MMA_BITS = (2, 3, 4, 8)
MMA_MAX_ROWS = 16  # query rows (G * M) of one KV head per call: one m16 score tile
# Warps per block. 8 (one table fill serves twice the tiles, 4 warps per scheduler at 2
# blocks per SM) measure faster than 4 on the H200 (tq4, chained calls incl. host time:
# 105 vs 113 us at 128k, 59 vs 65 at 32k; docs/decode_kernels.md).
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
# What the automatic choice sends to the tensor-core kernel: on the H200 it is as fast as or
# faster than the dialect kernels from 4k keys on at D 64, 128 and 256 (gemma-like shape, tq4:
# 44 / 53 / 58 us vs 76 / 77 / 96 at 4k / 32k / 128k; docs/decode_kernels.md). Below 4k keys
# the dialect kernels serve.
MMA_AUTO_HEAD_DIMS = (64, 128, 256)
MMA_AUTO_MIN_CONTEXT = 4096
MMA_MAX_SPLITS = 1024
# Lookup addresses by one PRMT (tq_decode_mma.kernel, PL) where a variant allows it: on the
# H200 (llama shape, per call at 128k) tq4 75.8 us against 85.6 without, tq3 77.0 against 95.3,
# k8v4 128.1 against 136.8; 4k unchanged (docs/decode_kernels.md).
MMA_PRMT_LOOKUPS = True
# Shared memory for the warps' rings of in-flight tiles: cp.async keeps the bytes in flight
# out of registers. With 8 warps, 48 KB is 2 slots of 2.4 KB per warp at tq4, D 128 (one
# tile in flight while one is worked on); 3 or 4 slots measured the same on the H200.
MMA_RING_BYTES = 48 * 1024
MMA_MAX_STAGES = 4
# A protected layer's launch has R more blocks per (b, KV head) for its FP16 rows (DENSE). Where
# they do not fit in the splits' wave, the splits make room for them if that adds at most this
# many tiles per warp: at 4k keys on the H100 (llama shape, whole-model decode) 8 splits of 2
# tiles per warp beside them made the step 1.10x FP16's against 1.19x with 16 splits of 1 tile
# and the FP16 blocks in a second wave; at 128k making room would add a third to every warp's
# loop (43 tiles instead of 32) to spare one FP16 block's few microseconds.
MMA_DENSE_WAVE_TILES = 1

_LOG2E = 1.4426950408889634


def _lut_entries(bits: int) -> int:
    return 256 if bits == 8 else 1 << (2 * bits)


def _mma_lut(side: SideQuant) -> mx.array:
    """The side's lookup table for tq_decode_mma: centroids * sqrt(d) in float16, one
    half2 per pair of codes for 2/3/4 bits (the pair's bits as the packing lays them
    out: plane 0 bits of both coordinates, then the high plane's for 3 bits), one half
    per code for 8 bits."""
    cache = TABLES.setdefault(side, {})
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
        cache["mma_lut"] = resident(mx.array(table.astype(np.uint32)))
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
    dense: tuple | None = None,
    commit_rows: int = 1,
) -> MmaConfig:
    """The MmaConfig of a call shape, cached beside the K tables: a decode step only adds
    the split count (the kernel derives keys per warp from it). dense: a protected layer's
    (sink rows, window rows, ring slots, key mean or not), whose FP16 rows the kernel reads
    (DENSE), or None."""
    cache = TABLES.get(quant.k) or TABLES.setdefault(quant.k, {})
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
        dense,
        commit_rows,
    )
    cfg = cache.get(key)
    if cfg is None:
        cfg = cache[key] = _mma_config_uncached(
            quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype, dense, commit_rows
        )
    return cfg


def _mma_regs(quant: LayerQuant, head_dim: int, RP: int) -> int:
    """Registers per thread a variant wants (sm_90, tests' nvcc compile): ~128 for 2/3/4-bit K
    at D <= 128 with 8 rows, up to ~168 with 8-bit K or 16 rows, more at D 256. Only variants
    at <= 128 get 16 warps; every build is bounded to its block size anyway
    (build._cuda_launch_bounds), so this chooses speed (no spills), not launchability."""
    if head_dim <= 128:
        return 128 if (RP == 8 and quant.k.bits != 8) else 168
    return 255


def _mma_tables(quant: LayerQuant) -> tuple[mx.array, dict[str, int]]:
    """The K table, the V table, Π_K and Π_V (float32 bits) as one uint32 array, and the word
    offsets of the last three (template values): each input of a custom-kernel call costs
    host time at every step (~0.15 us to build, as much to encode, on the H200 host)."""
    parts = [_mma_lut(quant.k), _mma_lut(quant.v), rotation_arg(quant.k)[1], rotation_arg(quant.v)[1]]
    at = np.cumsum([0] + [a.size for a in parts[:-1]]).tolist()
    merged = resident(mx.concatenate([a.reshape(-1).view(mx.uint32) for a in parts]))
    return merged, {"VTAB_AT": at[1], "KROT_AT": at[2], "VROT_AT": at[3]}


def _mma_config_uncached(
    quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype, dense=None, commit_rows=1
):
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
        # (A DENSE block's merge of its warps, tq_fp16_rows.h, takes nwarp * (D + 2) + D words.)
        smem = 4 * max(
            tables_words + D * RP + RP + 32 + ring_words,
            nwarp * (R * (D + 12) + 2 * RP),
            nwarp * (D + 2) + D if dense else 0,
        )
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
        ("KROT", rotation_arg(quant.k)[0]),
        ("VROT", rotation_arg(quant.v)[0]),
        ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale * _LOG2E))[0]),
        ("HAS_STARTS", has_starts),
        ("HAS_SINK", has_sink),
        ("VLUT_OFF", vlut_off),
        ("PL", pl),
        *offsets.items(),
        ("TICKET_WORDS", MMA_TICKET_WORDS),
        ("OT", out_dtype),
        ("CB", commit_rows),
        ("DENSE", dense is not None),
        ("SINK_ROWS", dense[0] if dense else 0),
        ("WINDOW_ROWS", dense[1] if dense else 0),
        ("RING_SLOTS", dense[2] if dense else 1),
        ("HAS_MEAN", bool(dense and dense[3])),
    )
    return MmaConfig(template, smem, R, RP, nwarp, per_sm, [tables], [])


def _mma_splits(
    cfg: MmaConfig, tiles: int, n_seq_heads: int, tiles_per_warp: int | None = None, extra: int = 0
) -> int:
    """Splits per (b, KV head): one wave of resident blocks (at most MMA_BLOCKS_PER_SM per SM)
    over all (b, KV head), at least MMA_MIN_TILES 16-key tiles per warp (the tables cost each
    block a fill), at most MMA_MAX_SPLITS splits. extra: the launch's other blocks per
    (b, KV head) (DENSE), left room in the wave where that costs a warp at most
    MMA_DENSE_WAVE_TILES more tiles."""
    if tiles_per_warp is None:
        wave = MMA_SMS * min(cfg.per_sm, MMA_BLOCKS_PER_SM)

        def per_warp(blocks: int) -> int:
            """Tiles per warp with `blocks` blocks of one wave for the splits."""
            return max(
                max(1, MMA_MIN_TILES * MMA_WARPS // cfg.nwarp),  # keys per block, not per warp
                -(-tiles // (cfg.nwarp * max(1, blocks // n_seq_heads))),
                -(-tiles // (cfg.nwarp * MMA_MAX_SPLITS)),
            )

        tiles_per_warp = per_warp(wave)
        splits = -(-tiles // (cfg.nwarp * tiles_per_warp))
        if extra and n_seq_heads * (splits + extra) > wave:  # the other blocks spill out of the wave
            roomy = per_warp(wave - n_seq_heads * extra)
            if roomy <= tiles_per_warp + MMA_DENSE_WAVE_TILES:
                tiles_per_warp = roomy
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
    dense: tuple | None = None,
    commit_rows: int = 1,
) -> dict:
    """Template values, launch shape and shared memory of one tq_decode_mma call."""
    cfg = _mma_config(
        quant, group, rows, head_dim, scale, has_starts, has_sink, out_dtype, dense, commit_rows
    )
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
    commit_rows: int = 1,
    _tiles_per_warp: int | None = None,
) -> mx.array:
    """`tq_decode_attention` on CUDA tensor cores, in one launch (see tq_decode_mma.kernel).

    fp16 operands with fp32 accumulation: q'/||q'||, centroids and softmax weights are
    rounded to fp16 (relative 2^-11), so the output matches the fp32 reference to ~1e-3
    relative, far below the 4-bit quantization error it sits on.

    This runs once per layer and decode step, so everything but the split count is cached
    per call shape (MmaLaunch).
    """
    launch = mma_launch(
        quant, queries, k_codes.shape[1], scale, isinstance(kv_start, mx.array), sinks is not None,
        commit_rows=commit_rows,
    )
    if launch.reason is not None:
        raise _backend.KernelUnsupported(f"tensor-core decode cannot serve this: {launch.reason}")
    return launch(queries, k_codes, k_norms, v_codes, v_norms, position, kv_start, sinks, _tiles_per_warp)


class MmaLaunch:
    """What a tq_decode_mma call shape (quant, query shape and dtype, KV heads, scale, starts,
    sinks, a protected layer's FP16 rows) needs at every step, and its launch shape per 16-key
    tile count: host time per call is what bounds decode, and a decode step repeats one shape
    per layer. `reason`: why the kernel cannot serve the shape (then the rest is unset), or None."""

    def __init__(
        self, quant: LayerQuant, queries: mx.array, Hkv: int, scale, has_starts, has_sink,
        dense: tuple | None = None, commit_rows: int = 1,
    ):  # fmt: skip
        B, Hq, M, D = queries.shape
        G = Hq // Hkv
        self.reason = tq_mma_unsupported(quant, G, M, D)
        self.rows = M
        # The automatic choice (tq_decode_attention) takes this kernel at this head dim (from
        # MMA_AUTO_MIN_CONTEXT keys on).
        self.auto = D in MMA_AUTO_HEAD_DIMS
        if self.reason is not None:
            return
        self.quant, self.scale, self.commit_rows = quant, scale, commit_rows
        self.per = max(1, MMA_MAX_ROWS // G)  # query rows one launch takes
        self.batch = B
        self.n_seq_heads = B * Hkv
        self.by_tiles: dict[int, tuple] = {}
        self._kernel = None
        self.dense = dense
        if self.per < M:  # launches of `per` rows each (split_rows), each its own shape
            return
        self.cfg = _mma_config(quant, G, M, D, scale, has_starts, has_sink, queries.dtype, dense, commit_rows)
        self.tables = self.cfg.tables[0]
        self.part_words = self.cfg.R * D + 2 * self.cfg.RP  # one partial (tq_decode_mma.kernel)
        # DENSE: R more blocks per (b, KV head), one FP16-rows partial of D + 3 words each.
        self.dense_blocks = self.cfg.R if dense else 0
        self.head_dim = D
        self.threadgroup = (32 * self.cfg.nwarp, 1, 1)
        self.dtype = queries.dtype
        self.output_shapes = [(B, Hq, M, D)]
        self.output_dtypes = [queries.dtype]

    def __call__(
        self, queries, k_codes, k_norms, v_codes, v_norms, position, kv_start, sinks, tiles_per_warp=None,
        dense_rows=None,
    ):  # fmt: skip
        """dense_rows: [k_sinks, v_sinks, k_recent, v_recent, k_mean] of a protected layer
        (DENSE; the sink arrays are the ring's without sink rows, the mean _ZEROS8 without
        one); `position` is then the first query position less window and sink rows, and
        kv_start is not shifted."""
        if self.per < self.rows:
            if self.dense is not None:
                raise _backend.KernelUnsupported(
                    f"{self.rows} query rows take several launches: no FP16 rows"
                )
            return split_rows(
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
                commit_rows=self.commit_rows,
                _tiles_per_warp=tiles_per_warp,
            )
        return self.launch(
            queries, k_codes, k_norms, v_codes, v_norms, dense_rows or _NO_DENSE, position, kv_start, sinks,
            tiles_per_warp,
        )  # fmt: skip

    def launch(
        self, queries, k_codes, k_norms, v_codes, v_norms, dense_rows, position, kv_start, sinks,
        tiles_per_warp=None,
    ) -> mx.array:  # fmt: skip
        """One launch of `per` or fewer query rows (__call__ without the split): a protected
        layer's decode step calls this straight, with its five dense_rows."""
        tiles = max(1, (_committed(position + self.rows, self.commit_rows) + 15) // 16)
        shape = self.by_tiles.get(tiles) if tiles_per_warp is None else None
        if shape is None:
            shape = self.shape(tiles, tiles_per_warp)
        grid, part_words = shape
        chain = _mma_chain(self.dtype, part_words)
        LAUNCHES["tq_decode_mma"] += 1
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
                sinks_arg(sinks),
                *dense_rows,
                *step_args(position, kv_start, self.batch),
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
        splits = _mma_splits(self.cfg, tiles, self.n_seq_heads, tiles_per_warp, self.dense_blocks)
        blocks = splits + self.dense_blocks
        words = self.n_seq_heads * (splits * self.part_words + self.dense_blocks * (self.head_dim + 3))
        shape = ((32 * self.cfg.nwarp * blocks, self.n_seq_heads, 1), words)
        if tiles_per_warp is None:
            if len(self.by_tiles) >= 4096:  # contexts only grow: older counts are done with
                self.by_tiles.clear()
            self.by_tiles[tiles] = shape
        return shape


_NO_DENSE = [_ZEROS8] * 5


def _committed(n: int, commit_rows: int) -> int:
    """ts_committed<CB>(n) of tq_common.h: n floored to whole commit blocks (n <= 0 as is)."""
    return n if commit_rows == 1 or n <= 0 else n // commit_rows * commit_rows


def mma_launch(
    quant: LayerQuant, queries: mx.array, Hkv: int, scale, has_starts, has_sink, dense: tuple | None = None,
    commit_rows: int = 1,
) -> MmaLaunch:
    """The MmaLaunch of a call shape, cached beside the K tables (dropped with the layer)."""
    cache = TABLES.get(quant.k) or TABLES.setdefault(quant.k, {})
    key = ("launch", quant.v, queries.shape, queries.dtype, Hkv, scale, has_starts, has_sink, dense,
           commit_rows)  # fmt: skip
    launch = cache.get(key)
    if launch is None:
        launch = cache[key] = MmaLaunch(
            quant, queries, Hkv, scale, has_starts, has_sink, dense, commit_rows
        )
    return launch
