"""Kernel arguments shared by the GPU ops: device-resident tables, per-step integers and
sinks in the forms MLX passes cheaply, and the split of a call's query rows.

Tables are cached per `SideQuant` (weakly: dropped with the layer) and never on a cache
instance, since caches get deep-copied.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from ..quant.packing import PLANES
from ..quant.tables import SideQuant

_ZEROS8 = mx.zeros((8,), mx.float32)
_ZEROS8_I32 = mx.zeros((8,), mx.int32)
TABLES: "weakref.WeakKeyDictionary[SideQuant, dict[str, mx.array]]" = weakref.WeakKeyDictionary()


def resident(a: mx.array) -> mx.array:
    """A copy of `a` made by an op, evaluated. On MLX CUDA an array built from host data
    lives in managed memory, which a kernel reads through page faults or over PCIe; an
    op's output lives in device memory. (`a` stays referenced, so MLX cannot donate its
    buffer to the copy.)"""
    b = a + 0
    mx.eval(b)
    return b


def padded_table(side: SideQuant, name: str) -> mx.array:
    """side.centroids / side.boundaries padded to >= 8 entries, so Metal always passes them in
    `device` space (MLX puts inputs of < 8 elements in `constant` space: another signature)."""
    cache = TABLES.setdefault(side, {})
    if name not in cache:
        a = getattr(side, name).astype(mx.float32)
        if a.size < 8:
            a = mx.concatenate([a, mx.zeros((8 - a.size,), mx.float32)])
        cache[name] = resident(a)
    return cache[name]


def rotation_arg(side: SideQuant) -> tuple[int, mx.array]:
    """(ROT template value, array) for a side: 0 and the (D,) signs of a randomized
    Hadamard, or 1 and the (D, D) dense Π. The kernels apply it in float32."""
    cache = TABLES.setdefault(side, {})
    if "rot" not in cache:
        r = side.rotation
        arr = r.signs if r.kind == "hadamard" else r.matrix
        cache["rot"] = (0 if r.kind == "hadamard" else 1, resident(arr.astype(mx.float32)))
    return cache["rot"]


def bits_reason(side: SideQuant, what: str) -> str | None:
    if side.bits not in PLANES:
        return f"{what} bits {side.bits} have no kernel (kernels cover {sorted(PLANES)})"
    return None


_LENGTHS = [mx.zeros((1 << 16,), mx.uint8)]
_LENGTH_VIEWS: dict[int, mx.array] = {}


def length_arg(n: int) -> mx.array:
    """An array of n + 1 bytes, a prefix view of one buffer: how a per-step integer (the
    query position, kv_start) reaches a kernel, which reads it from `<input>_shape`, a
    launch parameter. A host-made mx.array lands in MLX CUDA's managed memory: in ncu on
    the H200 the decode kernel's first read of one stalled its warps (37% of the stall
    samples at 4k keys). The buffer's bytes are never read, so nothing is copied or moved.
    Views are kept per n, so the layers of one decode step share one (a slice costs ~1.4 us
    of host time)."""
    view = _LENGTH_VIEWS.get(n)
    if view is None:
        buf = _LENGTHS[0]
        if buf.size <= n:
            buf = _LENGTHS[0] = mx.zeros((max(n + 1, 2 * buf.size),), mx.uint8)
        if len(_LENGTH_VIEWS) >= 64:  # positions only grow: older views are done with
            _LENGTH_VIEWS.clear()
        view = _LENGTH_VIEWS[n] = buf[: n + 1]
    return view


# The last int-start call's ((position, kv_start), step_args): the layers of a decode step share it.
# One tuple, read once per call, so a call never pairs one key with another call's arguments.
_LAST_STEP_ARGS: tuple = (None, None)


def step_args(position: int, kv_start: int | mx.array, batch: int) -> list[mx.array]:
    """The decode kernels' per-step inputs (qpos, kv0, kv_starts): the first query position
    and an int kv_start as lengths, per-sequence starts as a >= 8-element int32 array
    (unused zeros for an int start). Callers unpack the list and never change it."""
    global _LAST_STEP_ARGS
    if not isinstance(kv_start, mx.array):
        key, last = (position, kv_start), _LAST_STEP_ARGS
        if last[0] == key:
            return last[1]
        args = [length_arg(position), length_arg(int(kv_start)), _ZEROS8_I32]
        _LAST_STEP_ARGS = (key, args)
        return args
    starts = mx.broadcast_to(kv_start.astype(mx.int32).reshape(-1), (batch,))
    if batch < 8:
        starts = mx.concatenate([starts, mx.zeros((8 - batch,), mx.int32)])
    return [length_arg(position), length_arg(0), starts]


def sinks_arg(sinks: mx.array | None) -> mx.array:
    """Sink logits as a >= 8-element float32 array (unused zeros without sinks)."""
    if sinks is None:
        return _ZEROS8
    a = sinks.astype(mx.float32)
    return mx.concatenate([a, mx.zeros((8 - a.size,), mx.float32)]) if a.size < 8 else a


def split_rows(fn, per: int, queries: mx.array, *args, position: int, **kwargs) -> mx.array:
    """`fn` over query rows [m0, m0 + per) (at positions position + m0), concatenated: for
    calls with more rows than one launch takes."""
    parts = [
        fn(queries[:, :, m0 : m0 + per], *args, position=position + m0, **kwargs)
        for m0 in range(0, queries.shape[2], per)
    ]
    return mx.concatenate(parts, axis=2)
