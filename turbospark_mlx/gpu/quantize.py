"""The commit's quantize step on the GPU: `kernels/tq_quantize.kernel` (staged rows) and
`kernels/tq_commit.kernel` (a protected layer's rows leaving its window, K and V in one
launch), with `quant.reference.quantize_ref` as their twin and the CPU path."""

from __future__ import annotations

import mlx.core as mx

from ..quant.reference import quantize_ref
from ..quant.tables import LayerQuant, SideQuant
from . import backend as _backend
from .args import _ZEROS8, bits_reason, length_arg, padded_table, rotation_arg
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


def tq_commit(
    k_ring: mx.array,
    v_ring: mx.array,
    first: int,
    n: int,
    quant: LayerQuant,
    ring_capacity: int,
    k_mean: mx.array | None = None,
    backend: str = "cuda",
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Positions [first, first + n) of a protected layer's K and V rings (position p in slot
    p % ring_capacity) -> (k_codes, k_norms, v_codes, v_norms), each (B, H, n, ...), the keys
    centred by k_mean (B, H, D) first: `kernels/tq_commit.kernel`, one launch for both sides
    on a GPU backend. The reference path is `cache.window.commit`'s `quantize_ref` per side."""
    B, H, slots, D = k_ring.shape
    (krot_kind, krot), (vrot_kind, vrot) = rotation_arg(quant.k), rotation_arg(quant.v)
    KW, VW = quant.k.words, quant.v.words
    k_codes, k_norms, v_codes, v_norms = launch(
        "tq_commit",
        backend,
        [
            ("T", k_ring.dtype),
            ("D", D),
            ("KB", quant.k.bits),
            ("KW", KW),
            ("KROT", krot_kind),
            ("VB", quant.v.bits),
            ("VW", VW),
            ("VROT", vrot_kind),
            ("RCAP", ring_capacity),
            ("CENTER", k_mean is not None),
        ],
        inputs=[
            k_ring.reshape(B * H, slots, D),
            v_ring.reshape(B * H, slots, D),
            length_arg(first),
            length_arg(n),
            _ZEROS8 if k_mean is None else k_mean,
            krot,
            padded_table(quant.k, "boundaries"),
            vrot,
            padded_table(quant.v, "boundaries"),
        ],
        grid=(32 * B * H * n, 2, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(B * H, n, KW), (B * H, n), (B * H, n, VW), (B * H, n)],
        output_dtypes=[mx.uint32, mx.float32, mx.uint32, mx.float32],
    )
    return (
        k_codes.reshape(B, H, n, KW),
        k_norms.reshape(B, H, n),
        v_codes.reshape(B, H, n, VW),
        v_norms.reshape(B, H, n),
    )
