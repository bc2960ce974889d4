"""Packing b-bit codebook indices into uint32 words.

Layout (per vector of d indices, last axis):
  * b = 1, 2, 4, 8 divide 32, so one plane holds 32/b indices per word and no
    index ever spans two words.
  * b = 3 is split into two planes: the low 2 bits (16 indices per word), then
    the high bit (32 indices per word). Codes packed densely across byte/word
    edges cost decode most of its time in unpacking; here every index is read
    with one shift and mask from an aligned word, and 3 bits still cost exactly
    3 bits per coordinate (no 10-per-word waste).
  * Inside a plane, word w holds coordinates [w·n, (w+1)·n) (n = 32/width),
    coordinate w·n + s at bits [s·width, (s+1)·width): a thread that owns a
    contiguous run of coordinates loads consecutive, aligned words.
  * Planes are concatenated along the last axis; each is padded to a whole word.
"""

from __future__ import annotations

import mlx.core as mx

# Plane widths, low bits first.
PLANES: dict[int, tuple[int, ...]] = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}


def _plane_words(head_dim: int, width: int) -> int:
    per_word = 32 // width
    return -(-head_dim // per_word)


def packed_words(head_dim: int, bits: int) -> int:
    """uint32 words holding one vector's d indices at `bits` bits."""
    if bits not in PLANES:
        raise ValueError(f"cannot pack {bits}-bit indices; valid bits: {sorted(PLANES)}")
    return sum(_plane_words(head_dim, w) for w in PLANES[bits])


def pack_indices(idx: mx.array, bits: int) -> mx.array:
    """(..., d) integer indices in [0, 2**bits) → (..., packed_words(d, bits)) uint32."""
    d = idx.shape[-1]
    idx = idx.astype(mx.uint32)
    planes = []
    shift = 0
    for width in PLANES[bits]:
        per_word = 32 // width
        n_words = _plane_words(d, width)
        part = (idx >> shift) & ((1 << width) - 1)
        pad = n_words * per_word - d
        if pad:
            part = mx.pad(part, [(0, 0)] * (part.ndim - 1) + [(0, pad)])
        part = part.reshape(*part.shape[:-1], n_words, per_word)
        lane_shift = mx.arange(per_word, dtype=mx.uint32) * width
        # Bit fields are disjoint, so the sum is an exact bitwise OR.
        planes.append(mx.sum(part << lane_shift, axis=-1))
        shift += width
    return planes[0] if len(planes) == 1 else mx.concatenate(planes, axis=-1)


def unpack_indices(words: mx.array, bits: int, head_dim: int) -> mx.array:
    """(..., packed_words(d, bits)) uint32 → (..., d) uint32 indices."""
    expected = packed_words(head_dim, bits)
    if words.shape[-1] != expected:
        raise ValueError(
            f"{bits}-bit codes for head_dim {head_dim} need {expected} words, got {words.shape[-1]}"
        )
    idx = None
    start = 0
    shift = 0
    for width in PLANES[bits]:
        per_word = 32 // width
        n_words = _plane_words(head_dim, width)
        plane = words[..., start : start + n_words]
        lane_shift = mx.arange(per_word, dtype=mx.uint32) * width
        part = (plane[..., None] >> lane_shift) & ((1 << width) - 1)
        part = part.reshape(*plane.shape[:-1], n_words * per_word)[..., :head_dim] << shift
        idx = part if idx is None else idx | part
        start += n_words
        shift += width
    return idx
