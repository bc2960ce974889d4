"""A protected layer's FP16 rows (sink rows, recent window) as one softmax partial per query
row: `kernels/tq_dense_partial.kernel` (CUDA), merged by the tensor-core decode kernel
(`decode_mma`, HAS_EXTRA). Its twin is `quant.reference.fp16_rows_partial_ref`, which the
other paths merge in plain mx ops."""

from __future__ import annotations

import struct

import mlx.core as mx

from ..quant.tables import SideQuant
from .args import _ZEROS8, rotation_arg, step_args
from .build import launch

THREADS = 128


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
) -> mx.array:
    """(B * Hkv, R, D + 3) float32: per query row (R = G * M per KV head) the FP16 rows'
    o' = Π_V Σ exp(s - m) v, m, l and scale · q·k_mean (see the kernel).

    arrays: the layer's storage (k_sinks, v_sinks, k_recent, v_recent, optional k_mean).
    """
    B, Hq, M, D = queries.shape
    k_recent = arrays["k_recent"]
    Hkv = k_recent.shape[1]
    G = Hq // Hkv
    mean = arrays.get("k_mean")
    sinks = (arrays["k_sinks"], arrays["v_sinks"]) if sink_rows else (k_recent, arrays["v_recent"])
    vrot_kind, vrot = rotation_arg(v_side)
    (part,) = launch(
        "tq_dense_partial",
        "cuda",
        [
            ("D", D),
            ("G", G),
            ("M", M),
            ("R", G * M),
            ("S", sink_rows),
            ("W", window_rows),
            ("RCAP", ring_capacity),
            ("KMAX", max(1, sink_rows + window_rows)),
            ("NT", THREADS),
            ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", scale))[0]),
            ("HAS_MEAN", mean is not None),
            ("HAS_STARTS", isinstance(kv_start, mx.array)),
            ("VROT", vrot_kind),
        ],
        inputs=[
            queries,
            *sinks,
            k_recent,
            arrays["v_recent"],
            _ZEROS8 if mean is None else mean,
            vrot,
            *step_args(position, kv_start, B),
        ],
        grid=(THREADS * G * M, B * Hkv, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B * Hkv, G * M, D + 3)],
        output_dtypes=[mx.float32],
    )
    return part
