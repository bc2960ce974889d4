"""Seeded random rotations Π for TurboQuant (arXiv 2504.19874, §3).

Power-of-two head_dim: a randomized Hadamard transform Π = H·diag(s)/√d with
random signs s; it costs O(d log d), needs only d signs of storage, and spreads
outlier coordinates as well as a dense rotation does in practice.
Other head_dim (e.g. 96): the Q factor of a seeded Gaussian matrix (the paper's
own construction), d² floats, which is small at those sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

ROTATION_KINDS = ("auto", "hadamard", "dense")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def resolve_rotation_kind(kind: str, head_dim: int) -> str:
    """Map "auto" to the concrete kind for head_dim and check the request."""
    if kind not in ROTATION_KINDS:
        raise ValueError(f"unknown rotation kind {kind!r}; valid: {', '.join(ROTATION_KINDS)}")
    if kind == "auto":
        return "hadamard" if is_power_of_two(head_dim) else "dense"
    if kind == "hadamard" and not is_power_of_two(head_dim):
        raise ValueError(
            f"a Hadamard rotation needs a power-of-two head_dim, got {head_dim}; use 'dense' or 'auto'"
        )
    return kind


def seeded_rng(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator per (seed, layer, side, ...) stream."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


@dataclass(frozen=True, eq=False)
class Rotation:
    """An orthogonal d×d map applied along the last axis.

    Attributes:
        kind: "hadamard" or "dense".
        head_dim: d.
        signs: (d,) float32 ±1 for "hadamard", else None.
        matrix: (d, d) float32 Π for "dense", else None.
    """

    kind: str
    head_dim: int
    signs: mx.array | None = None
    matrix: mx.array | None = None

    @classmethod
    def make(cls, kind: str, head_dim: int, rng: np.random.Generator) -> "Rotation":
        kind = resolve_rotation_kind(kind, head_dim)
        if kind == "hadamard":
            signs = rng.integers(0, 2, size=head_dim) * 2 - 1
            return cls(kind, head_dim, signs=mx.array(signs.astype(np.float32)))
        g = rng.standard_normal((head_dim, head_dim))
        q, r = np.linalg.qr(g)
        q *= np.sign(np.diag(r))  # makes Q Haar-distributed, not just orthogonal
        return cls(kind, head_dim, matrix=mx.array(q.astype(np.float32)))

    @property
    def array(self) -> mx.array:
        """The signs of a Hadamard rotation, else the matrix: what `rotate` takes."""
        return self.signs if self.kind == "hadamard" else self.matrix

    def apply(self, x: mx.array) -> mx.array:
        """Π x along the last axis, in float32."""
        return rotate(x.astype(mx.float32), self.kind, self.array)

    def invert(self, y: mx.array) -> mx.array:
        """Πᵀ y along the last axis, in float32."""
        return unrotate(y.astype(mx.float32), self.kind, self.array)

    @cached_property
    def dense(self) -> mx.array:
        """Π as a (d, d) float32 matrix (built once for Hadamard, e.g. for a kernel)."""
        if self.matrix is not None:
            return self.matrix
        return self.apply(mx.eye(self.head_dim)).T


def rotate(x: mx.array, kind: str, r: mx.array) -> mx.array:
    """Π x for a rotation given as its kind and `Rotation.array` (a graph input)."""
    return mx.hadamard_transform(x * r) if kind == "hadamard" else x @ r.T


def unrotate(y: mx.array, kind: str, r: mx.array) -> mx.array:
    """Πᵀ y for a rotation given as its kind and `Rotation.array`."""
    return mx.hadamard_transform(y) * r if kind == "hadamard" else y @ r
