"""The FP16 rows of a protected TurboQuant layer: a ring of recent rows (the window), the sink
rows and the key mean, and the commit that quantizes rows as they leave the window.

docs/cache_design.md ("Protected layers") describes the design.
"""

from __future__ import annotations

import mlx.core as mx

from ..gpu.quantize import tq_quantize
from ..quant.tables import SIDES


def fixed_layout(l, config, batch_size: int, dtype: mx.Dtype) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Name -> (shape, dtype) of a protected layer's fixed-size arrays: the FP16 ring of recent
    rows (at its full capacity), the FP16 sink rows and the key mean (empty for other layers)."""
    if not l.recent_capacity:
        return {}
    B, H, D = batch_size, l.spec.n_kv_heads, l.spec.head_dim
    out = {f"{s}_recent": ((B, H, l.recent_capacity, D), dtype) for s in SIDES}
    out.update({f"{s}_sinks": ((B, H, config.sink_rows, D), dtype) for s in SIDES})
    if config.center_keys:
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


def commit(cache, l, position: int, m: int) -> None:
    """Commit M staged rows at `position` on protected layer `l`: the rows go to the FP16 ring
    (and the sink rows), and the rows that leave the window by this commit are quantized from
    the ring into their code slots (slot p - sink_rows)."""
    S, W, R = cache.config.sink_rows, cache.config.window_rows, l.recent_capacity
    end = position + m
    buf = cache.stage.buffers(l.spec.n_kv_heads, l.spec.head_dim)
    for side in SIDES:
        rows = buf[side][:, :, :m]
        ring = l.arrays[f"{side}_recent"]
        if ring.shape[2] < min(end, R):  # grow in whole steps; slot p % R is slot p until full
            rows_needed = min(R, -(-end // cache.step) * cache.step)
            grown = mx.zeros((*ring.shape[:2], rows_needed - ring.shape[2], ring.shape[3]), dtype=ring.dtype)
            ring = l.arrays[f"{side}_recent"] = mx.concatenate([ring, grown], axis=2)
        if position < S:
            n = min(S, end) - position
            l.arrays[f"{side}_sinks"][:, :, position : position + n] = rows[:, :, :n]
        start = position % R
        first = min(m, R - start)
        ring[:, :, start : start + first] = rows[:, :, :first]
        if first < m:
            ring[:, :, : m - first] = rows[:, :, first:]
    q0, q1 = max(S, position - W), max(S, end - W)
    if q1 <= q0:
        return
    cache._reserve(l, q1 - S)  # codes only for the rows that left the window
    if cache.config.center_keys and q0 == S:  # the first quantized rows: estimate the mean
        at = mx.array([p % R for p in range(S, S + W)])
        l.arrays["k_mean"] = mx.take(l.arrays["k_recent"], at, axis=2).astype(mx.float32).mean(axis=2)
    at = mx.array([p % R for p in range(q0, q1)])
    for side in SIDES:
        rows = mx.take(l.arrays[f"{side}_recent"], at, axis=2)
        if side == "k" and cache.config.center_keys:
            rows = rows.astype(mx.float32) - l.arrays["k_mean"][:, :, None, :]
        codes, norms = tq_quantize(rows, l.quant.side(side))
        cache._put(l, f"{side}_codes", q0 - S, codes)  # slot p - S: the sink rows have no codes
        cache._put(l, f"{side}_norms", q0 - S, norms)
