"""The reference backend's compiled one-row paths (quant/compiled.py) and the half-word
centroid lookup against the oracles in quant/reference.py."""

import mlx.core as mx
import pytest

from turbospark_mlx.quant import compiled
from turbospark_mlx.quant.compiled import (
    HOST_STEP_MIN_ROWS,
    STEP_MAX_ROWS,
    commit_row_ref,
    protected_step_ref,
)
from turbospark_mlx.quant.packing import pack_indices
from turbospark_mlx.quant.reference import centroids_of, quantize_ref, tq_attention_ref
from turbospark_mlx.quant.tables import LayerQuant, side_quant


def layer_quant(k_bits: int, v_bits: int, head_dim: int, rotation: str = "auto") -> LayerQuant:
    k = side_quant(k_bits, head_dim, rotation, 0, 0, "k")
    return LayerQuant(0, k, side_quant(v_bits, head_dim, rotation, 0, 0, "v"))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])
def test_half_word_lookup_equals_per_index_gather(bits, head_dim):
    tables = side_quant(bits, head_dim, "auto", 0, 0, "k")
    mx.random.seed(bits * head_dim)
    idx = mx.random.randint(0, 2**bits, (2, 3, 9, head_dim)).astype(mx.uint32)
    codes = pack_indices(idx, bits)
    assert (tables.half_word_table is None) == (bits == 3)  # 3-bit codes span two planes
    got = centroids_of(codes[:, :, 2:7], tables)  # a slice, as a step reads the codes
    assert mx.array_equal(got, mx.take(tables.centroids, idx[:, :, 2:7])).item()


def test_layers_of_one_codebook_share_one_half_word_table():
    # One array per codebook keeps a step's lookups in the CPU's caches (quant/tables.py).
    first, later = side_quant(4, 64, "auto", 0, 0, "k"), side_quant(4, 64, "auto", 7, 29, "v")
    assert first.rotation is not later.rotation and first.half_word_table is later.half_word_table
    for other in (side_quant(8, 64, "auto", 0, 0, "k"), side_quant(4, 128, "auto", 0, 0, "k")):
        assert other.half_word_table is not first.half_word_table
        want = mx.take(other.centroids, mx.arange(2**other.bits))
        assert mx.array_equal(other.half_word_table[: 2**other.bits, 0], want).item()


def codes_and_rows(quant, B, H, L, Ld, D, seed):
    mx.random.seed(seed)
    k = mx.random.normal((B, H, L, D)) + 2.0
    v = mx.random.normal((B, H, L, D))
    kc, kn = quantize_ref(k, quant.k)
    vc, vn = quantize_ref(v, quant.v)
    dense = [mx.random.normal((B, H, Ld, D)).astype(mx.float16) for _ in range(2)] if Ld else [None, None]
    return kc, kn, vc, vn, dense


@pytest.mark.parametrize(
    "bits,rotation", [((8, 4), "auto"), ((4, 4), "auto"), ((3, 3), "auto"), ((4, 8), "dense")]
)
@pytest.mark.parametrize("B,Ld", [(1, 20), (2, 7), (2, 0)])
@pytest.mark.parametrize("with_sinks,with_mean", [(False, False), (True, True)])
def test_step_equals_oracle(bits, rotation, B, Ld, with_sinks, with_mean):
    H, G, D = 2, 3, 64
    quant = layer_quant(*bits, D, rotation)
    sinks = mx.random.normal((H * G,)) if with_sinks else None
    mean = mx.random.normal((B, H, D)) if with_mean else None
    # One graph per layout serves every length: the rows grow as a decode step's do, and a
    # single code row (which the graph must not meet) goes to the oracle. From
    # HOST_STEP_MIN_ROWS rows the centroids come from numpy's take.
    for L in (5, 2, 1, 9, HOST_STEP_MIN_ROWS + 44):
        lo = 3  # the step reads slots [lo, lo + L) of the storage
        kc, kn, vc, vn, (keys, values) = codes_and_rows(quant, B, H, lo + L, Ld, D, seed=L)
        q = mx.random.normal((B, H * G, 1, D))
        kw = dict(scale=0.125, sinks=sinks, key_mean=mean)
        got = protected_step_ref(q, keys, values, (kc, kn, vc, vn), (lo, lo + L), quant, **kw)
        if L == 1:
            assert got is None
            continue
        dense = None if keys is None else (keys, values, None)
        read = [a[:, :, lo:] for a in (kc, kn, vc, vn)]
        want = tq_attention_ref(q, *read, quant, dense=dense, **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (L, mx.abs(got - want).max().item())


def test_step_leaves_long_histories_off_the_host_and_single_fp16_rows_to_the_oracle(monkeypatch):
    quant = layer_quant(4, 4, 64)
    L = STEP_MAX_ROWS + 1
    kc, kn, vc, vn, (keys, values) = codes_and_rows(quant, 1, 2, L, 1, 64, seed=0)
    q = mx.random.normal((1, 2, 1, 64))
    codes = (kc, kn, vc, vn)
    assert protected_step_ref(q, keys, values, codes, (0, 3), quant, scale=0.125) is None
    # On the CPU device the host step takes any length, in blocks of STEP_MAX_ROWS rows.
    got = protected_step_ref(q, None, None, codes, (0, L), quant, scale=0.125)
    want = tq_attention_ref(q, *codes, quant, scale=0.125)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    monkeypatch.setattr(compiled, "HOST_STEP_MIN_ROWS", 10**9)  # as off the CPU device
    assert protected_step_ref(q, None, None, codes, (0, L), quant, scale=0.125) is None


@pytest.mark.parametrize("with_dense,with_sinks,with_mean", [(False, False, False), (True, True, True)])
def test_host_step_in_blocks_equals_oracle(monkeypatch, with_dense, with_sinks, with_mean):
    """Blocks of 16 rows over 100 (the last one short): the online softmax across blocks."""
    monkeypatch.setattr(compiled, "STEP_MAX_ROWS", 16)
    B, H, G, D, L, lo = 2, 2, 3, 64, 100, 5
    quant = layer_quant(8, 4, D)
    kc, kn, vc, vn, (keys, values) = codes_and_rows(quant, B, H, lo + L, 9 if with_dense else 0, D, seed=3)
    q = mx.random.normal((B, H * G, 1, D))
    kw = dict(scale=0.125, sinks=mx.random.normal((H * G,)) if with_sinks else None,
              key_mean=mx.random.normal((B, H, D)) if with_mean else None)  # fmt: skip
    got = protected_step_ref(q, keys, values, (kc, kn, vc, vn), (lo, lo + L), quant, **kw)
    read = [a[:, :, lo:] for a in (kc, kn, vc, vn)]
    want = tq_attention_ref(q, *read, quant, dense=None if keys is None else (keys, values, None), **kw)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize("bits,rotation", [((8, 4), "auto"), ((3, 3), "auto"), ((4, 2), "dense")])
@pytest.mark.parametrize("with_mean", [False, True])
def test_commit_row_equals_quantize(bits, rotation, with_mean):
    B, H, D = 2, 3, 64
    quant = layer_quant(*bits, D, rotation)
    mx.random.seed(1)
    k = (mx.random.normal((B, H, 1, D)) * 3).astype(mx.float16)
    v = mx.random.normal((B, H, 1, D)).astype(mx.float16)
    mean = mx.random.normal((B, H, D)) if with_mean else None
    got = commit_row_ref(k, v, quant, mean)
    kf = k.astype(mx.float32) - (0 if mean is None else mean[:, :, None, :])
    want = (*quantize_ref(kf, quant.k), *quantize_ref(v, quant.v))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    for i in (0, 2):  # the same cells, bit for bit
        assert mx.array_equal(got[i], want[i]).item()
    for i in (1, 3):
        assert mx.allclose(got[i], want[i], rtol=1e-6).item()
