"""The TurboQuant tables of a compressed layer: per side (K, V) a seeded rotation and a
Lloyd-Max codebook (arXiv 2504.19874, Algorithm 1). The plain-mx quantizer and attention
that use them are in `reference.py`; the GPU kernels in `turbospark_mlx.gpu`.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache

import mlx.core as mx
import numpy as np

from .codebook import lloyd_max_codebook
from .packing import PLANES, packed_words
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

    @cached_property
    def half_word_table(self) -> mx.array | None:
        """(65536, 16 // bits) float32: the centroids of the coordinates one 16-bit half of a
        packed word holds, in coordinate order; None where a half word does not hold whole
        indices of one plane (3-bit codes) or the machine is big-endian.

        A lookup by half word decodes 2 (8-bit) or 4 (4-bit) coordinates per gather: MLX's CPU
        gather costs about the same per index at any slice size, so decoding takes 2-4x less
        time than a gather per coordinate (docs/backends.md, "The CPU backend's cache paths").
        """
        if len(PLANES[self.bits]) != 1 or self.bits > 8 or sys.byteorder != "little":
            return None
        return _half_word_table(self.bits, np.asarray(self.centroids, dtype=np.float32).tobytes())

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

    def side(self, name: str) -> SideQuant:
        return self.k if name == "k" else self.v


@lru_cache(maxsize=None)
def _half_word_table(bits: int, centroids: bytes) -> mx.array:
    """`SideQuant.half_word_table` of a codebook, one array for every layer that shares it: a
    decode step's lookups then stay in one table of 0.5-1 MB, where a table per layer missed
    the CPU's caches (docs/backends.md, "The CPU backend's cache paths")."""
    per_half, mask = 16 // bits, (1 << bits) - 1
    halves = np.arange(1 << 16, dtype=np.uint32)[:, None]
    idx = (halves >> (np.arange(per_half, dtype=np.uint32) * bits)) & mask
    return mx.array(np.frombuffer(centroids, dtype=np.float32)[idx])


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
