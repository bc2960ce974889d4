"""The FP16 rows of a protected TurboQuant layer: a ring of recent rows (the window), the sink
rows and the key mean, and the commit that quantizes rows as they leave the window.

docs/cache_design.md ("Protected layers") describes the design.
"""

from __future__ import annotations

import mlx.core as mx

from ..gpu import backend as _backend
from ..gpu.args import bits_reason
from ..gpu.quantize import tq_commit, tq_quantize
from ..quant.compiled import commit_row_ref
from ..quant.tables import SIDES


def fixed_layout(l, config, batch_size: int, dtype: mx.Dtype) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Name -> (shape, dtype) of a layer's fixed-size arrays: on a protected layer the FP16 ring
    of recent rows (at its full capacity), the FP16 sink rows and the key mean; on a bounded
    FP16 ring its sink rows; empty for other layers."""
    B, H, D = batch_size, l.spec.n_kv_heads, l.spec.head_dim
    out = {}
    if l.recent_capacity:
        out.update({f"{s}_recent": ((B, H, l.recent_max, D), dtype) for s in SIDES})
    if l.recent_capacity or l.sink_rows:
        out.update({f"{s}_sinks": ((B, H, l.sink_rows, D), dtype) for s in SIDES})
    if l.recent_capacity and config.center_keys:
        out["k_mean"] = ((B, H, D), mx.float32)
    return out


def empty_fixed(layout: dict) -> dict[str, mx.array]:
    """The fixed arrays before any write: the ring holds no slots yet (it grows in steps, like
    storage, up to its capacity)."""
    out = {}
    for name, (shape, dtype) in layout.items():
        if name.endswith("_recent"):
            shape = (*shape[:2], 0, shape[3])
        out[name] = mx.zeros(shape, dtype=dtype)
    return out


def check_fixed(layer: int, name: str, a: mx.array, want: tuple, dtype: mx.Dtype) -> None:
    """A fixed array as given from outside (files, adapters): the ring may hold fewer slots."""
    if name.endswith("_recent") and a.ndim == 4 and a.shape[2] <= want[2]:
        want = (*want[:2], a.shape[2], want[3])
    if a.shape != want or a.dtype != dtype:
        raise ValueError(f"layer {layer}: {name} is {(a.shape, a.dtype)}, expected {(want, dtype)}")


# Ring slots a protected layer keeps beyond its uncommitted rows between writes of more rows
# (prefill chunks): room for a decode step, a speculative verify and the trim after it, without
# the max_rows slots a chunk needs (docs/cache_design.md, "The ring's room for a chunk").
RING_SLACK_ROWS = 64


def ring_modulus(cache, m: int) -> int:
    """Slots of a protected layer's ring for an m-row write: its uncommitted rows (the FP16 rows
    a query may read) and room for the write, at least `RING_SLACK_ROWS` (up to max_rows)."""
    return cache.config.uncommitted_rows + max(m, min(cache.max_rows, RING_SLACK_ROWS))


def fit(cache, l, position: int, m: int) -> None:
    """Give an unbounded protected layer's ring the modulus an m-row write at `position` needs
    (`ring_modulus`), re-laying its rows where the modulus changes: a chunk's write takes room
    for its rows, the next decode step gives it back. The rows kept are the newest
    modulus - m before `position`; the old ring holds them all (its modulus was at least
    uncommitted_rows + RING_SLACK_ROWS), so after the write every slot holds a position and
    `trim` may give back modulus - uncommitted_rows rows, as with a fixed ring."""
    T, R = ring_modulus(cache, m), l.recent_capacity
    if T == R or l.keep is not None:  # a bounded layer's codes ring is sized for max_rows
        return
    names = [f"{s}_recent" for s in SIDES]
    n = l.arrays[names[0]].shape[2]
    if position <= n <= T and position + m <= T:  # unwrapped, and stays so: slot p is slot p
        l.recent_capacity = T
        return
    # The ring holds the newest R positions up to the offset, less any a trim or re-lay dropped.
    lo = max(0, position - (T - m), position - R, l.recent_from)
    size = T if position + m > T else min(T, -(-position // cache.step) * cache.step)
    for name in names:
        ring = l.arrays[name]
        new = mx.zeros((*ring.shape[:2], size, ring.shape[3]), dtype=ring.dtype)
        put_rows(new, lo, ring_rows(ring, lo, position, R), T)
        l.arrays[name] = new
    l.recent_capacity, l.recent_from = T, lo


def check_ring(cache, layer: int, l, n: int, offset: int) -> None:
    """A ring of n slots given from outside (files, adapters) for `offset` positions: one the
    offset runs past has wrapped at n slots, which must hold the uncommitted rows and the
    room of a decode step (`ring_modulus`); a bounded layer's ring wraps only when full."""
    if offset <= n:
        return
    least = l.recent_max if l.keep is not None else ring_modulus(cache, 1)
    if n < least:
        raise ValueError(
            f"layer {layer}: offset {offset} needs an FP16 ring of at least {least} slots, {n} given"
        )


def adopt(l, recent_from: int = 0) -> None:
    """Take the modulus of a ring given from outside (after `check_ring`): its length where the
    offset runs past it, else the largest (slot p is slot p either way)."""
    n = l.arrays["k_recent"].shape[2]
    l.recent_capacity = n if l.offset > n else l.recent_max
    l.recent_from = recent_from


def write(cache, l, side: str, position: int, rows: mx.array) -> None:
    """M rows of one side straight into the FP16 ring (and the sink rows), which is the
    layer's staging: the ring keeps room for the write beyond the rows a query may read in FP16
    (window_rows + commit_rows - 1), so the slots an M <= max_rows write takes hold rows
    that already have codes and that neither this commit's quantize nor a trim of the
    committed positions reads."""
    R, S = l.recent_capacity, cache.config.sink_rows
    m, end = rows.shape[2], position + rows.shape[2]
    name = f"{side}_recent"
    ring = l.arrays[name]
    if ring.shape[2] < min(end, R):  # grow in whole steps; slot p % R is slot p until full
        rows_needed = min(R, -(-end // cache.step) * cache.step)
        grown = mx.zeros((*ring.shape[:2], rows_needed - ring.shape[2], ring.shape[3]), dtype=ring.dtype)
        ring = l.arrays[name] = mx.concatenate([ring, grown], axis=2)
    if position < S:
        n = min(S, end) - position
        l.arrays[f"{side}_sinks"][:, :, position : position + n] = rows[:, :, :n]
    put_rows(ring, position, rows, R)


def put_rows(ring: mx.array, position: int, rows: mx.array, capacity: int) -> None:
    """Rows of positions [position, position + M) into slots p % capacity of `ring`, in place:
    one slice update, or two where the range wraps."""
    m = rows.shape[2]
    start = position % capacity
    first = min(m, capacity - start)
    ring[:, :, start : start + first] = rows if first == m else rows[:, :, :first]
    if first < m:
        ring[:, :, : m - first] = rows[:, :, first:]


def commit(cache, l, position: int, m: int) -> None:
    """Commit M rows written at `position` on protected layer `l` (already in the ring): the
    rows that leave the window by this commit, whole blocks of commit_rows
    (`TurboQuantConfig.committed_end`), are quantized from the ring into their code slots
    (slot p - sink_rows)."""
    S, W, R = cache.config.sink_rows, cache.config.window_rows, l.recent_capacity
    end = position + m
    q0, q1 = cache.config.committed_end(position), cache.config.committed_end(end)
    if q1 <= q0:
        return
    cache._reserve(l, q1 - S)  # codes only for the rows that left the window
    if cache.config.center_keys and q0 == S:  # the first quantized rows: estimate the mean
        l.arrays["k_mean"] = ring_rows(l.arrays["k_recent"], S, S + W, R).astype(mx.float32).mean(axis=2)
    k_mean = l.arrays["k_mean"] if cache.config.center_keys else None
    quant, a = l.quant, l.arrays
    backend = _backend.resolve(bits_reason(quant.k, "K") or bits_reason(quant.v, "V"))
    if backend != "reference":  # both sides in one launch
        rows = tq_commit(a["k_recent"], a["v_recent"], q0, q1 - q0, quant, R, k_mean, backend)
    elif q1 - q0 == 1:  # a decode step's row: one compiled graph
        s = q0 % R
        rows = commit_row_ref(a["k_recent"][:, :, s : s + 1], a["v_recent"][:, :, s : s + 1], quant, k_mean)
    else:
        rows = []
        for side in SIDES:
            x = ring_rows(a[f"{side}_recent"], q0, q1, R)
            if side == "k" and k_mean is not None:
                x = x.astype(mx.float32) - k_mean[:, :, None, :]
            rows.extend(tq_quantize(x, quant.side(side), backend))
    for name, r in zip(("k_codes", "k_norms", "v_codes", "v_norms"), rows):
        cache._put(l, name, q0 - S, r)  # slot p - S: the sink rows have no codes


def ring_rows(ring: mx.array, p0: int, p1: int, capacity: int) -> mx.array:
    """Positions [p0, p1) (at most `capacity` of them) of a ring whose position p sits in slot
    p % capacity, in position order: one slice, or two joined where the range wraps."""
    s0, s1 = p0 % capacity, p0 % capacity + p1 - p0
    if s1 <= capacity:
        return ring[:, :, s0:s1]
    return mx.concatenate([ring[:, :, s0:], ring[:, :, : s1 - capacity]], axis=2)
