"""A bounded cache (`max_kv_size`): every layer that would hold more than N positions keeps its
first sink rows and its newest N - sinks positions, as mlx-lm's RotatingKVCache(keep=4) does,
in FP16 rings or in a protected TurboQuant layer whose codes are a ring; reference backend."""

import mlx.core as mx
import pytest
from test_cache_protected import B, D, G, HKV, data, protected, run

from turbospark_mlx import KVCacheManager, LayerSpec, attention_any, get_preset, store_kv
from turbospark_mlx.cache.manager import BOUNDED_SINK_ROWS
from turbospark_mlx.quant import dequantize_ref
from turbospark_mlx.quant.reference import fp16_attention_ref


def oracle(k, v, q, keep, S, full=None, sinks=None):
    """Each query row t over the positions p < S and (t - keep, t] only. With `full` (an
    unbounded cache holding the same rows), positions the protected layer reads from codes
    (below committed_end(t + 1), beyond its sink rows) are those codes decoded."""
    L = k.shape[2]
    if full is not None:
        c, a, quant = full.config, full.layer_arrays(0), full.layer_quant(0)
        n = full.quantized_end(0) - S
        kq = dequantize_ref(a["k_codes"][:, :, :n], a["k_norms"][:, :, :n], quant.k) + a["k_mean"][:, :, None, :]
        vq = dequantize_ref(a["v_codes"][:, :, :n], a["v_norms"][:, :, :n], quant.v)
    rows = []
    for t in range(L):
        seen = [p for p in range(t + 1) if p < S or p > t - keep]
        fp16 = [full is None or p < S or p >= c.committed_end(t + 1) for p in seen]
        kt = mx.stack([k[:, :, p].astype(mx.float32) if f else kq[:, :, p - S] for p, f in zip(seen, fp16)], 2)
        vt = mx.stack([v[:, :, p].astype(mx.float32) if f else vq[:, :, p - S] for p, f in zip(seen, fp16)], 2)
        rows.append(fp16_attention_ref(q[:, :, t : t + 1], kt, vt, scale=D**-0.5, sinks=sinks))
    return mx.concatenate(rows, axis=2)


def close(a, b):
    return mx.allclose(a, b, atol=3e-5, rtol=1e-4).item()


@pytest.mark.parametrize("chunks", [[1] * 150, [40, 64, 5, 41]], ids=["steps", "chunks"])
def test_fp16_ring_keeps_sinks_and_newest(chunks):
    L, N = 150, 24
    k, v, q = data(L)
    sinks = mx.random.normal((HKV * G,))
    got, cache = run("fp16", k, v, q, chunks, sinks=sinks, max_kv_size=N)
    S = BOUNDED_SINK_ROWS
    assert close(got, oracle(k, v, q, N - S, S, sinks=sinks))
    assert cache.layer_keep(0) == N - S and cache.sink_rows(0) == S
    assert "fp16 ring w=20" in cache.summary()


# commit 30: a row may hold up to 45 FP16 rows beyond its sink rows, more than the 40 it keeps.
@pytest.mark.parametrize("base,commit", [("tq4", 1), ("k8v4", 1), ("tq4", 4), ("tq4", 30)])
@pytest.mark.parametrize("chunks", [[1] * 150, [40, 64, 5, 41]], ids=["steps", "chunks"])
def test_protected_codes_ring_keeps_sinks_and_newest(base, commit, chunks):
    L, N, S = 150, 44, 4
    k, v, q = data(L, bias=3.0)
    sinks = mx.random.normal((HKV * G,))
    config = protected(window=16, sinks=S, base=base, commit=commit)
    got, cache = run(config, k, v, q, chunks, sinks=sinks, max_kv_size=N)
    _, full = run(config, k, v, q, [64, 64, 22])  # the same codes for every position
    assert close(got, oracle(k, v, q, N - S, S, full=full, sinks=sinks))
    # Codes for keep - window positions, plus max_rows - 1 so a chunk's first row finds its own.
    assert cache.ring_capacity(0) == N - S - 16 + 64 - 1
    assert cache.layer_arrays(0)["k_codes"].shape[2] == cache.ring_capacity(0)


def test_memory_stops_growing():
    k, v, q = data(400, bias=1.0)
    _, short = run(protected(), k[:, :, :200], v[:, :, :200], q[:, :, :200], [64] * 3 + [8], max_kv_size=60)
    _, long = run(protected(), k, v, q, [64] * 6 + [16], max_kv_size=60)
    assert short.nbytes == long.nbytes
    _, grows = run(protected(), k, v, q, [64] * 6 + [16])
    assert long.nbytes < grows.nbytes
    # In use: the 60 positions a query reads (4 sinks and 16 window rows uncompressed, 40 coded).
    rows = 2 * B * HKV * D * 2  # K and V of one position, float16
    coded = 40 * B * HKV * long.config.bytes_per_token(D)
    in_use = (20 * rows + coded + B * HKV * D * 4, 60 * rows)  # stored with the key mean, uncompressed
    assert short.bytes_in_use() == long.bytes_in_use() == in_use
    assert grows.bytes_in_use()[1] == 400 * rows


def test_trim_then_rewrite_reads_as_before(tmp_path):
    L, N = 150, 44
    k, v, q = data(L, bias=2.0)
    for config in (protected(), "fp16"):
        _, cache = run(config, k, v, q, [64, 64, 22], max_kv_size=N)
        before = attention_any(cache, 0, q[:, :, L - 1 :], L - 1)
        loaded = KVCacheManager.from_file(cache.save(str(tmp_path / "c")))
        assert loaded.max_kv_size == N
        loaded.trim(40)
        store_kv(loaded, 0, L - 40, k[:, :, L - 40 :], v[:, :, L - 40 :])
        assert mx.array_equal(attention_any(loaded, 0, q[:, :, L - 1 :], L - 1), before).item()


def test_choices_and_errors():
    spec = [LayerSpec(HKV, D), LayerSpec(HKV, D, window=8)]
    # tq4's window of 256 FP16 rows holds all that max_kv_size=100 keeps: no codes at all.
    small = KVCacheManager(spec, "tq4", max_kv_size=100)
    assert small.layer_quant(0) is None and small.layer_keep(0) == 96
    # A sliding layer narrower than the bound keeps its own window and no sink rows.
    assert small.layer_keep(1) == 8 and small.sink_rows(1) == 0
    assert KVCacheManager(spec, "tq4", max_kv_size=1000).layer_quant(0) is not None
    with pytest.raises(ValueError, match="protected preset"):
        KVCacheManager(spec, get_preset("tq4").plain(), max_kv_size=1000)
    with pytest.raises(ValueError, match="must exceed the 4 sink rows"):
        KVCacheManager(spec, "fp16", max_kv_size=4)
    with pytest.raises(ValueError, match="max_kv_size must be an int >= 1"):
        KVCacheManager(spec, "fp16", max_kv_size=0)
    c = KVCacheManager(spec, "fp16", max_kv_size=50)
    with pytest.raises(ValueError, match="bounded"):
        c.set_layer_arrays(0, {}, 0)
