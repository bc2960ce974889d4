"""A protected layer's FP16 rows (sink rows, recent window) as one softmax partial per query
row, merged by the tensor-core decode kernel (`decode_mma`, HAS_EXTRA): alone
(`kernels/tq_dense_partial.kernel`) or with the commit of the rows leaving the window in the
same launch (`kernels/tq_commit_dense.kernel`, a decode step). CUDA only. The partial's twin is
`quant.reference.fp16_rows_partial_ref`, the commit's `quant.reference.quantize_ref`."""

from __future__ import annotations

import struct

import mlx.core as mx

from ..quant.tables import LayerQuant, SideQuant
from .args import _ZEROS8, length_arg, padded_table, rotation_arg, step_args
from .build import LAUNCHES, cuda_kernel, launch

THREADS = 128


def _dense_template(
    queries: mx.array, Hkv: int, v_side: SideQuant, scale: float, has_mean: bool, starts: bool,
    sink_rows: int, window_rows: int, ring_capacity: int, commit_rows: int,
) -> list[tuple]:  # fmt: skip
    B, Hq, M, D = queries.shape
    G = Hq // Hkv
    return [
        ("D", D),
        ("G", G),
        ("M", M),
        ("R", G * M),
        ("S", sink_rows),
        ("W", window_rows),
        ("CB", commit_rows),
        ("RCAP", ring_capacity),
        ("KMAX", max(1, sink_rows + window_rows + commit_rows - 1)),
        ("NT", THREADS),
        ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale))[0]),
        ("HAS_MEAN", has_mean),
        ("HAS_STARTS", starts),
        ("VROT", rotation_arg(v_side)[0]),
    ]


def _dense_inputs(queries, arrays, v_side, position, kv_start, sink_rows) -> list[mx.array]:
    k_recent = arrays["k_recent"]
    mean = arrays.get("k_mean")
    sinks = (arrays["k_sinks"], arrays["v_sinks"]) if sink_rows else (k_recent, arrays["v_recent"])
    return [
        queries,
        *sinks,
        k_recent,
        arrays["v_recent"],
        _ZEROS8 if mean is None else mean,
        rotation_arg(v_side)[1],
        *step_args(position, kv_start, queries.shape[0]),
    ]


def tq_dense_partial(
    queries: mx.array,
    arrays: dict[str, mx.array],
    v_side: SideQuant,
    *,
    scale: float,
    position: int,
    kv_start: int | mx.array,
    sink_rows: int,
    window_rows: int,
    ring_capacity: int,
    commit_rows: int = 1,
) -> mx.array:
    """(B * Hkv, R, D + 3) float32: per query row (R = G * M per KV head) the FP16 rows'
    o' = Π_V Σ exp(s - m) v, m, l and scale · q·k_mean (see kernels/tq_fp16_rows.h).

    arrays: the layer's storage (k_sinks, v_sinks, k_recent, v_recent, optional k_mean).
    """
    B, Hq, M, D = queries.shape
    Hkv = arrays["k_recent"].shape[1]
    G = Hq // Hkv
    starts = isinstance(kv_start, mx.array)
    has_mean = "k_mean" in arrays
    template = _dense_template(
        queries, Hkv, v_side, scale, has_mean, starts, sink_rows, window_rows, ring_capacity, commit_rows
    )
    (part,) = launch(
        "tq_dense_partial",
        "cuda",
        template,
        inputs=_dense_inputs(queries, arrays, v_side, position, kv_start, sink_rows),
        grid=(THREADS * G * M, B * Hkv, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B * Hkv, G * M, D + 3)],
        output_dtypes=[mx.float32],
    )
    return part


class CommitDense:
    """`tq_commit_dense` and `tq_dense_partial` for one call shape of a protected layer (quant,
    query shape and dtype, ring, scale, starts, window, commit block): the kernel objects and
    the constant inputs are built once, since a decode step calls one of them for every layer.
    Call it with the layer's arrays, the first query position, kv_start, and the first of the
    n rows to commit; `partial` is the step that commits nothing."""

    def __init__(self, quant: LayerQuant, queries: mx.array, arrays: dict[str, mx.array], *, scale: float,
                 starts: bool, sink_rows: int, window_rows: int, ring_capacity: int,
                 commit_rows: int = 1):  # fmt: skip
        B, Hq, M, D = queries.shape
        ring = arrays["k_recent"]
        Hkv = ring.shape[1]
        has_mean = "k_mean" in arrays
        template = _dense_template(queries, Hkv, quant.v, scale, has_mean, starts, sink_rows, window_rows,
                                   ring_capacity, commit_rows)  # fmt: skip
        self.dense_kernel = cuda_kernel("tq_dense_partial", tuple(template))
        self.dense_grid = (THREADS * (Hq // Hkv) * M, B * Hkv, 1)
        self.dense_shape = [(B * Hkv, (Hq // Hkv) * M, D + 3)]
        template += [("KB", quant.k.bits), ("KW", quant.k.words), ("KROT", rotation_arg(quant.k)[0]),
                     ("VB", quant.v.bits), ("VW", quant.v.words)]  # fmt: skip
        self.kernel = cuda_kernel("tq_commit_dense", tuple(template))
        self.quant, self.sink_rows, self.batch = quant, sink_rows, B
        k_bnd, v_bnd = padded_table(quant.k, "boundaries"), padded_table(quant.v, "boundaries")
        self.tables = [rotation_arg(quant.k)[1], k_bnd, v_bnd]  # after tq_dense_partial's inputs
        self.BH, self.R, self.D = B * Hkv, (Hq // Hkv) * M, D
        self.threadgroup = (THREADS, 1, 1)
        self.by_rows: dict[int, tuple] = {}

    def _shapes(self, n: int) -> tuple:
        shape = self.by_rows.get(n)
        if shape is None:
            B, BH, D, q = self.batch, self.BH, self.D, self.quant
            H = BH // B
            blocks = max(self.R, -(-BH * n // (THREADS // 32)))
            shape = self.by_rows[n] = (
                (THREADS * blocks, BH + 2, 1),
                [(B, H, n, q.k.words), (B, H, n), (B, H, n, q.v.words), (B, H, n), (BH, self.R, D + 3)],
                [mx.uint32, mx.float32, mx.uint32, mx.float32, mx.float32],
            )
        return shape

    def partial(self, queries, arrays, position: int, kv_start) -> mx.array:
        """The FP16 rows' partial alone (tq_dense_partial)."""
        LAUNCHES["tq_dense_partial"] += 1
        return self.dense_kernel(
            inputs=_dense_inputs(queries, arrays, self.quant.v, position, kv_start, self.sink_rows),
            grid=self.dense_grid,
            threadgroup=self.threadgroup,
            output_shapes=self.dense_shape,
            output_dtypes=[mx.float32],
        )[0]

    def __call__(self, queries, arrays, position: int, kv_start, first: int, n: int) -> list[mx.array]:
        """[k_codes, k_norms, v_codes, v_norms] of positions [first, first + n), and the partial."""
        grid, shapes, dtypes = self._shapes(n)
        dense = _dense_inputs(queries, arrays, self.quant.v, position, kv_start, self.sink_rows)
        LAUNCHES["tq_commit_dense"] += 1
        return self.kernel(
            inputs=[*dense, *self.tables, length_arg(first), length_arg(n)],
            grid=grid,
            threadgroup=self.threadgroup,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
