"""The commit's quantize step on the GPU: `kernels/tq_quantize.kernel`, with
`quant.reference.quantize_ref` as its twin and the CPU path."""

from __future__ import annotations

import mlx.core as mx

from ..quant.reference import quantize_ref
from ..quant.tables import SideQuant
from . import backend as _backend
from .args import bits_reason, padded_table, rotation_arg
from .build import launch


def tq_quantize_unsupported(x: mx.array, side: SideQuant) -> str | None:
    """Why the quantize kernel cannot serve these rows, or None."""
    if x.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"rows of dtype {x.dtype} (kernels take float16, bfloat16, float32)"
    return bits_reason(side, "code")


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
    rot_kind, rot = rotation_arg(side)
    codes, norms = launch(
        "tq_quantize",
        backend,
        [("T", x.dtype), ("D", d), ("BITS", side.bits), ("W", side.words), ("ROT", rot_kind)],
        inputs=[x.reshape(rows, d), rot, padded_table(side, "boundaries")],
        grid=(32 * rows, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(rows, side.words), (rows,)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return codes.reshape(*lead, side.words), norms.reshape(lead)
