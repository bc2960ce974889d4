"""TurboQuant_mse (arXiv 2504.19874, Algorithm 1) on plain mx ops.

    quantize:    y = Π (x / ||x||);  idx_j = #{boundaries < y_j};  store (idx, ||x||)
    dequantize:  x̂ = ||x|| · Πᵀ c[idx]

These `_ref` functions are the oracle the GPU kernels are tested against, and
the CPU backend. The QJL ("prod") variant is left out on purpose: it removes
inner-product bias but adds variance that softmax amplifies (peers measured
worse perplexity with it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from .codebook import lloyd_max_codebook
from .packing import pack_indices, packed_words, unpack_indices
from .rotation import Rotation, seeded_rng

SIDES = ("k", "v")


@dataclass(frozen=True, eq=False)
class SideQuant:
    """Quant tables of one side (K or V) of one layer.

    Attributes:
        bits: bits per coordinate.
        head_dim: d.
        rotation: the seeded Π.
        centroids: (2**bits,) float32 Lloyd-Max centroids for f_d.
        boundaries: (2**bits - 1,) float32 decision boundaries.
        words: uint32 words per packed vector.
    """

    bits: int
    head_dim: int
    rotation: Rotation
    centroids: mx.array
    boundaries: mx.array
    words: int

    def fingerprint(self) -> str:
        """A digest of the tables, to tell whether stored codes still decode the same."""
        h = hashlib.sha256()
        h.update(f"{self.bits}:{self.head_dim}:{self.rotation.kind}".encode())
        for a in (self.centroids, self.boundaries, self.rotation.signs, self.rotation.matrix):
            if a is not None:
                h.update(np.asarray(a).tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class LayerQuant:
    """The TurboQuant tables of one compressed layer: K and V sides."""

    layer: int
    k: SideQuant
    v: SideQuant

    def side(self, half: str) -> SideQuant:
        return self.k if half == "k" else self.v


@lru_cache(maxsize=None)
def side_quant(bits: int, head_dim: int, rotation: str, seed: int, layer: int, side: str) -> SideQuant:
    """Tables for (layer, side): the rotation is seeded per (seed, layer, side)."""
    cb = lloyd_max_codebook(head_dim, bits)
    rng = seeded_rng(seed, layer, SIDES.index(side))
    return SideQuant(
        bits=bits,
        head_dim=head_dim,
        rotation=Rotation.make(rotation, head_dim, rng),
        centroids=mx.array(cb.centroids),
        boundaries=mx.array(cb.boundaries),
        words=packed_words(head_dim, bits),
    )


def nearest_index_ref(y: mx.array, boundaries: mx.array, bits: int) -> mx.array:
    """Index of the Lloyd-Max cell of each y: the count of boundaries strictly below it.

    A branchless binary search (bits steps of one gather), so memory stays
    O(size of y) even for 8-bit codebooks.
    """
    idx = mx.zeros(y.shape, dtype=mx.uint32)
    for step in (1 << s for s in reversed(range(bits))):
        probe = mx.take(boundaries, idx + (step - 1))
        idx = idx + mx.where(y > probe, step, 0).astype(mx.uint32)
    return idx


def quantize_ref(x: mx.array, tables: SideQuant) -> tuple[mx.array, mx.array]:
    """(..., d) vectors → ((..., words) uint32 codes, (...,) float32 norms)."""
    x = x.astype(mx.float32)
    norms = mx.sqrt(mx.sum(x * x, axis=-1))
    # A zero vector maps to the middle cell and decodes to 0 through its norm.
    unit = x / mx.maximum(norms, 1e-30)[..., None]
    idx = nearest_index_ref(tables.rotation.apply(unit), tables.boundaries, tables.bits)
    return pack_indices(idx, tables.bits), norms


def dequantize_rotated_ref(codes: mx.array, norms: mx.array, tables: SideQuant) -> mx.array:
    """||x|| · c[idx]: the reconstruction in the rotated space, float32."""
    idx = unpack_indices(codes, tables.bits, tables.head_dim)
    return mx.take(tables.centroids, idx) * norms[..., None]


def dequantize_ref(codes: mx.array, norms: mx.array, tables: SideQuant) -> mx.array:
    """x̂ = ||x|| · Πᵀ c[idx], float32."""
    return tables.rotation.invert(dequantize_rotated_ref(codes, norms, tables))
