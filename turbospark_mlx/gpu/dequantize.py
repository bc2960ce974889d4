"""Packed codes back to rows on the GPU: `kernels/tq_dequantize.kernel`, with
`quant.reference.dequantize_ref` as its twin and the CPU path. A prefill chunk reads the
layer's history through it (`attention._prefill_attention`)."""

from __future__ import annotations

import mlx.core as mx

from ..quant.reference import dequantize_ref
from ..quant.tables import SideQuant
from . import backend as _backend
from .args import _ZEROS8, bits_reason, length_arg, padded_table, rotation_arg
from .build import launch

ROWS_PER_GROUP = 8  # one SIMD group per row


def tq_dequantize(
    codes: mx.array,
    norms: mx.array,
    side: SideQuant,
    n: int,
    dtype: mx.Dtype,
    mean: mx.array | None = None,
    backend: str | None = None,
) -> mx.array:
    """Slots [0, n) of (B, H, cap, words) codes and (B, H, cap) norms -> (B, H, n, D) rows in
    `dtype`, plus `mean` (B, H, D) on every row of its head when given (centred keys)."""
    if backend is None:
        backend = _backend.resolve(bits_reason(side, "code"))
    if backend == "reference":
        x = dequantize_ref(codes[:, :, :n], norms[:, :, :n], side)
        return (x if mean is None else x + mean[:, :, None, :]).astype(dtype)
    B, H, cap, W = codes.shape
    if not 0 <= n <= cap:
        raise ValueError(f"{n} slots asked of storage with {cap}")
    D = side.head_dim
    rot_kind, rot = rotation_arg(side)
    groups = max(1, -(-B * H * n // ROWS_PER_GROUP))
    (out,) = launch(
        "tq_dequantize",
        backend,
        [
            ("OT", dtype),
            ("D", D),
            ("BITS", side.bits),
            ("W", W),
            ("ROT", rot_kind),
            ("HAS_MEAN", mean is not None),
            ("NR", ROWS_PER_GROUP),
        ],
        inputs=[
            codes.reshape(B * H, cap, W),
            norms.reshape(B * H, cap),
            length_arg(n),
            padded_table(side, "centroids"),
            rot,
            _ZEROS8 if mean is None else mean.astype(mx.float32),
        ],
        grid=(32 * ROWS_PER_GROUP * groups, 1, 1),
        threadgroup=(32 * ROWS_PER_GROUP, 1, 1),
        output_shapes=[(B * H, n, D)],
        output_dtypes=[dtype],
    )
    return out.reshape(B, H, n, D)
