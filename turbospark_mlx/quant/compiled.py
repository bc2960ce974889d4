"""The reference backend's one-row hot paths as `mx.compile`d graphs: a decode step's
attention on a protected layer and the commit of the row that leaves its window.

On MLX's CPU backend a decode step is bound by the number of ops, not their size: each
costs microseconds to build and to run, and the oracles in `reference.py` spend about 200
ops per layer on what these do in two compiled calls and a few gathers (docs/backends.md,
"The CPU backend's cache paths"); from HOST_STEP_MIN_ROWS code rows the step's arithmetic
runs in numpy on the arrays' buffers (`_host_step`). They compute what the oracles compute,
in another order of float32 operations; tests/test_quant_compiled.py holds them to the oracles.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

from .reference import centroids_of, quantize_ref
from .rotation import rotate, unrotate
from .tables import LayerQuant, SideQuant

# Code rows up to which one compiled call decodes a step's codes at once (float32
# rows of both sides: 2 · B · H · rows · d · 4 bytes, 32 MiB at 8 KV heads, d = 128);
# longer histories take the oracle's blocks, or the host step's, which are this size too.
STEP_MAX_ROWS = 4096

# Code rows from which a step on the CPU device runs on the host (`_host_step`): numpy's take
# costs about a fifth of MLX's CPU gather per index and numpy's small ops a few microseconds,
# for a sync per layer and step (docs/backends.md, "The CPU backend's cache paths";
# benchmarks/results/cpu_speed.md).
HOST_STEP_MIN_ROWS = 64


@lru_cache(maxsize=None)
def _step_graph(
    k_kind: str, v_kind: str, scale: float, has_dense: bool, has_mean: bool, has_sinks: bool
) -> Callable:
    """The step's softmax over FP16 rows and code rows, compiled once per layout. Shapes
    are free (shapeless): the code rows grow by one every step."""

    def step(q, keys, values, k_cent, k_norms, v_cent, v_norms, k_mean, sinks, k_rot, v_rot):
        # q (B, H, G, 1, d) float32; keys, values (B, H, Ld, d); *_cent (B, H, L, d); *_norms (B, H, L)
        q_rot = rotate(q, k_kind, k_rot)
        s_codes = (q_rot @ k_cent[:, :, None].swapaxes(-1, -2)) * (scale * k_norms[:, :, None, None, :])
        if has_mean:  # q·mean: the part of the score the centred codes leave out
            s_codes = s_codes + scale * (q @ k_mean[:, :, None, :, None])
        m = s_codes.max(axis=-1, keepdims=True)
        if has_dense:
            s_dense = scale * (q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2))
            m = mx.maximum(m, s_dense.max(axis=-1, keepdims=True))
        if has_sinks:
            m = mx.maximum(m, sinks)
        p_codes = mx.exp(s_codes - m)
        denom = p_codes.sum(axis=-1, keepdims=True)
        # o' = Σ p_i ||v_i|| c_V[idx_i] in the rotated space, then Π_Vᵀ once.
        out = unrotate((p_codes * v_norms[:, :, None, None, :]) @ v_cent[:, :, None], v_kind, v_rot)
        if has_dense:
            p_dense = mx.exp(s_dense - m)
            denom = denom + p_dense.sum(axis=-1, keepdims=True)
            out = out + p_dense @ values.astype(mx.float32)[:, :, None]
        if has_sinks:
            denom = denom + mx.exp(sinks - m)
        return out / denom

    return mx.compile(step, shapeless=True)


def protected_step_ref(
    queries: mx.array,
    keys: mx.array | None,
    values: mx.array | None,
    codes: Sequence[mx.array],
    rows: tuple[int, int],
    quant: LayerQuant,
    *,
    scale: float,
    sinks: mx.array | None = None,
    key_mean: mx.array | None = None,
) -> mx.array | None:
    """One query row over FP16 rows and code rows that it all sees, in one softmax: what
    `tq_attention_ref(queries, *codes, quant, dense=(keys, values, None), ...)` computes
    over code slots [rows[0], rows[1]).

    Args:
        queries: (B, Hq, 1, d).
        keys, values: (B, H, Ld, d) FP16 rows (sinks and window), or None.
        codes: a layer's (k_codes, k_norms, v_codes, v_norms) storage, (B, H, slots, words)
            and (B, H, slots).
        rows: the code slots read, [lo, hi).
        sinks: (Hq,) sink logits, or None; key_mean: (B, H, d) or None.
    Returns:
        (B, Hq, 1, d) in the queries' dtype, or None for fewer than 2 code or FP16 rows or,
        off the host step, more than STEP_MAX_ROWS code rows (the caller then takes the oracle).
    """
    B, Hq, _, D = queries.shape
    (lo, hi), H = rows, codes[0].shape[1]
    # A shapeless graph must never meet a reduced axis of size 1: MLX 0.32 drops such a
    # reduction from the trace and crashes on replay (ml-explore/mlx#3201).
    if hi - lo < 2 or (keys is not None and keys.shape[2] < 2):
        return None
    k_codes, k_norms, v_codes, v_norms = codes
    on_host = hi - lo >= HOST_STEP_MIN_ROWS and mx.default_device() == mx.cpu
    if on_host and _host_table(quant.k) is not None and _host_table(quant.v) is not None:
        return _host_step(queries, keys, values, codes, rows, quant, scale, sinks, key_mean)
    if hi - lo > STEP_MAX_ROWS:
        return None
    none = mx.zeros((1,))  # stands in for an absent input: the graph for its layout ignores it
    graph = _step_graph(
        quant.k.rotation.kind, quant.v.rotation.kind, float(scale), keys is not None, key_mean is not None,
        sinks is not None,
    )  # fmt: skip
    out = graph(
        queries.astype(mx.float32).reshape(B, H, Hq // H, 1, D),
        none if keys is None else keys,
        none if values is None else values,
        _centroids(k_codes, lo, hi, quant.k, on_host),
        k_norms[:, :, lo:hi],
        _centroids(v_codes, lo, hi, quant.v, on_host),
        v_norms[:, :, lo:hi],
        none if key_mean is None else key_mean.astype(mx.float32),
        none if sinks is None else sinks.astype(mx.float32).reshape(1, H, Hq // H, 1, 1),
        quant.k.rotation.array,
        quant.v.rotation.array,
    )
    out = out.reshape(B, Hq, 1, D).astype(queries.dtype)
    if on_host:  # the host's rows exist already: evaluating frees them before the next layer's
        mx.eval(out)
    return out


def _host_step(queries, keys, values, codes, rows, quant, scale, sinks, key_mean) -> mx.array:
    """`_step_graph`'s arithmetic in numpy, on the buffers of the evaluated arrays (one sync
    per call): a code row's centroids come from the half-word tables (numpy's take) and never
    become MLX arrays, and numpy's small ops cost a few microseconds where MLX's CPU ops cost
    5-20. The code part's output is rotated back by MLX (Hadamard). numpy's BLAS runs on one
    thread here (`_blas_threads`)."""
    B, Hq, _, D = queries.shape
    (lo, hi), H = rows, codes[0].shape[1]
    k_codes, k_norms, v_codes, v_norms = codes
    q = queries.astype(mx.float32).reshape(B, H, Hq // H, D)
    q_rot = rotate(q, quant.k.rotation.kind, quant.k.rotation.array)
    dense = [] if keys is None else [keys.astype(mx.float32), values.astype(mx.float32)]
    extra = [] if key_mean is None else [key_mean.astype(mx.float32)]
    mx.eval(q, q_rot, k_codes, k_norms, v_codes, v_norms, *dense, *extra)
    with _blas_threads().limit(limits=1):
        qn, qr = np.asarray(q), np.asarray(q_rot)
        k_norms, v_norms = np.asarray(k_norms), np.asarray(v_norms)
        # q·mean: the part of the score the centred codes leave out
        shift = 0.0 if key_mean is None else scale * (qn @ np.asarray(extra[0])[:, :, :, None])
        m = np.full((B, H, Hq // H, 1), -np.inf, np.float32)
        if dense:
            s_dense = scale * (qn @ np.asarray(dense[0]).swapaxes(-1, -2))
            m = np.maximum(m, s_dense.max(axis=-1, keepdims=True))
        if sinks is not None:
            sink = np.asarray(sinks.astype(mx.float32)).reshape(1, H, Hq // H, 1)
            m = np.maximum(m, sink)
        # The code rows in blocks of STEP_MAX_ROWS with an online softmax: the decoded rows of a
        # block are the only transient, whatever the context.
        acc, denom = np.zeros((B, H, Hq // H, D), np.float32), np.zeros_like(m)
        for b0 in range(lo, hi, STEP_MAX_ROWS):
            b1 = min(hi, b0 + STEP_MAX_ROWS)
            k = _host_centroids(k_codes, b0, b1, quant.k)
            s_codes = (qr @ k.swapaxes(-1, -2)) * (scale * k_norms[:, :, None, b0:b1]) + shift
            m_new = np.maximum(m, s_codes.max(axis=-1, keepdims=True))
            alpha = np.exp(m - m_new)
            p = np.exp(s_codes - m_new)
            denom = denom * alpha + p.sum(axis=-1, keepdims=True)
            p *= v_norms[:, :, None, b0:b1]
            acc = acc * alpha + p @ _host_centroids(v_codes, b0, b1, quant.v)
            m = m_new
        out = unrotate(mx.array(acc), quant.v.rotation.kind, quant.v.rotation.array)
        if dense:
            p_dense = np.exp(s_dense - m)
            denom = denom + p_dense.sum(axis=-1, keepdims=True)
            out = out + mx.array(p_dense @ np.asarray(dense[1]))
        if sinks is not None:
            denom = denom + np.exp(sink - m)
    return (out / mx.array(denom)).reshape(B, Hq, 1, D).astype(queries.dtype)


def _host_centroids(codes: mx.array, lo: int, hi: int, tables: SideQuant) -> np.ndarray:
    """c[idx] of code slots [lo, hi) as numpy float32 (B, H, hi - lo, d), from an evaluated
    codes array's buffer (no copy of the codes) and the half-word table."""
    halves = np.asarray(codes)[:, :, lo:hi].view(np.uint16)  # a view of MLX's buffer, no copy
    found = np.take(_host_table(tables), halves, axis=0)
    return found.reshape(*halves.shape[:-1], -1)[..., : tables.head_dim]


def _centroids(codes: mx.array, lo: int, hi: int, tables: SideQuant, on_host: bool) -> mx.array:
    """c[idx] of code slots [lo, hi): (B, H, hi - lo, d) float32. On the host, numpy's take
    on the codes' buffer does the lookup: it evaluates the codes (a sync inside the step),
    so short histories stay in the graph."""
    if not on_host or _host_table(tables) is None:
        return centroids_of(codes[:, :, lo:hi], tables)
    return mx.array(_host_centroids(codes, lo, hi, tables))


@lru_cache(maxsize=None)
def _blas_threads() -> ThreadpoolController:
    """The process's BLAS libraries (numpy's; MKL under MLX's CPU matmuls where loaded), found at
    the first host step. Their threads stay idle through the host's small matmuls: numpy's BLAS
    threads and MKL's spinning against each other on the cores made a `k8v4` step 2.0-2.6x
    slower at 4k tokens on a 2-core VM (docs/backends.md, "The CPU backend's cache paths")."""
    return ThreadpoolController().select(user_api="blas")


@lru_cache(maxsize=None)
def _host_table(tables: SideQuant) -> np.ndarray | None:
    """The side's half-word table as numpy, or None where it has none (3-bit codes): asked
    once per side, since a step asks in every layer."""
    table = tables.half_word_table
    return None if table is None else np.asarray(table)


@lru_cache(maxsize=None)
def _commit_graph(quant: LayerQuant, has_mean: bool) -> Callable:
    """`quantize_ref` of one K row (centred first) and one V row, compiled once per layer
    and shape (a decode step commits one row per layer)."""

    def commit(k, v, k_mean):
        k = k.astype(mx.float32)
        if has_mean:
            k = k - k_mean[:, :, None, :]
        return (*quantize_ref(k, quant.k), *quantize_ref(v, quant.v))

    return mx.compile(commit)


def commit_row_ref(
    k_row: mx.array, v_row: mx.array, quant: LayerQuant, key_mean: mx.array | None
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(B, H, 1, d) K and V rows -> (k_codes, k_norms, v_codes, v_norms), as `quantize_ref`
    of the centred K row and of the V row."""
    graph = _commit_graph(quant, key_mean is not None)
    return graph(k_row, v_row, mx.zeros((1,)) if key_mean is None else key_mean)
