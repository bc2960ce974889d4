"""Reference attention: TurboQuant-from-codes vs dense math, FP16 paths vs dense math."""

import mlx.core as mx
import pytest

from conftest import plain, random_kv, rel_l2
from turbospark_mlx import KVCacheManager, LayerSpec, attention_any, store_kv
from turbospark_mlx.attention import attention_mask
from turbospark_mlx.gpu.backend import current_backend
from turbospark_mlx.quant.reference import fp16_attention_ref
from turbospark_mlx.quant import dequantize_ref


def fill(cache, layer, L, chunk=None, scale=1.0):
    spec = cache.specs[layer]
    k, v = random_kv(cache.batch_size, spec.n_kv_heads, L, spec.head_dim, scale=scale)
    chunk = chunk or L
    for s in range(0, L, chunk):
        store_kv(cache, layer, s, k[:, :, s : s + chunk], v[:, :, s : s + chunk])
    return k, v


def dequantized(cache, layer, end):
    a, q = cache.layer_arrays(layer), cache.layer_quant(layer)
    k = dequantize_ref(a["k_codes"][:, :, :end], a["k_norms"][:, :, :end], q.k)
    v = dequantize_ref(a["v_codes"][:, :, :end], a["v_norms"][:, :, :end], q.v)
    return k, v


@pytest.mark.parametrize("L", [1, 17, 300, 1025])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_tq_decode_equals_dense_over_dequantized(L, group, B, with_sinks):
    Hkv, D = 2, 128
    cache = KVCacheManager([LayerSpec(Hkv, D)], plain("k4v3"), batch_size=B, max_rows=L)
    fill(cache, 0, L)
    q = mx.random.normal((B, Hkv * group, 1, D))
    sinks = mx.random.normal((Hkv * group,)) if with_sinks else None
    got = attention_any(cache, 0, q, sinks=sinks)
    k, v = dequantized(cache, 0, L)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, sinks=sinks)
    assert got.shape == (B, Hkv * group, 1, D)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize("preset,D", [("tq2", 64), ("tq3", 96), ("tq4", 256), ("k8v4", 128), ("k8v3", 512)])
def test_tq_m_rows_causal_equals_dense(preset, D):
    """M query rows over packed history + the new rows, causal, with kv_start and sinks."""
    B, Hkv, G, L, M = 2, 2, 2, 40, 7
    cache = KVCacheManager([LayerSpec(Hkv, D)], plain(preset), batch_size=B, max_rows=64)
    fill(cache, 0, L, chunk=M)
    q = mx.random.normal((B, Hkv * G, M, D)).astype(mx.float16)
    sinks = mx.random.normal((Hkv * G,))
    kv_start = mx.array([0, 5])
    got = attention_any(cache, 0, q, sinks=sinks, kv_start=kv_start, scale=0.3)
    k, v = dequantized(cache, 0, L)
    mask = attention_mask(mx.arange(L), mx.arange(L - M, L), kv_start)
    want = fp16_attention_ref(q, k, v, scale=0.3, mask=mask, sinks=sinks)
    assert got.dtype == mx.float16
    if current_backend() == "reference":
        assert mx.allclose(got, want, rtol=2e-3, atol=2e-3).item()  # fp16 output rounding
    else:  # the kernels multiply fp16 operands (tests/test_gpu_kernels.py holds them to the same)
        rel = rel_l2(got, want)
        assert rel < 5e-3, rel


def test_tq_attention_is_close_to_exact_attention():
    """A sanity bound on quality: 4-bit TurboQuant attention vs FP16 attention on the raw K/V."""
    B, Hkv, D, L = 1, 4, 128, 512
    cache = KVCacheManager([LayerSpec(Hkv, D)], plain("tq4"), max_rows=L)
    k, v = fill(cache, 0, L)
    q = mx.random.normal((B, Hkv, 1, D))
    got = attention_any(cache, 0, q)
    exact = fp16_attention_ref(q, k, v, scale=D**-0.5)
    rel = rel_l2(got, exact)
    assert rel < 0.15, rel


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("M", [1, 5])
def test_fp16_layer_matches_dense(with_sinks, M):
    B, Hkv, G, D, L = 2, 2, 4, 64, 33
    cache = KVCacheManager([LayerSpec(Hkv, D)], plain("fp16"), batch_size=B)
    k, v = fill(cache, 0, L)
    q = mx.random.normal((B, Hkv * G, M, D))
    sinks = mx.random.normal((Hkv * G,)) if with_sinks else None
    mask = attention_mask(mx.arange(L), mx.arange(L - M, L))
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=mask, sinks=sinks)
    got = attention_any(cache, 0, q, sinks=sinks)
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()
    got = attention_any(cache, 0, q, sinks=sinks, kv_start=3)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=attention_mask(mx.arange(L), mx.arange(L - M, L), 3), sinks=sinks)
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_ring_layer_matches_windowed_dense(with_sinks):
    """A sliding-window ring after wrapping several times equals windowed attention over all keys."""
    B, Hkv, G, D, W, L = 1, 2, 2, 64, 16, 100
    cache = KVCacheManager([LayerSpec(Hkv, D, window=W)], plain("tq4"), batch_size=B, max_rows=4)
    assert cache.layer_quant(0) is None and cache.ring_capacity(0) == W + 3
    k, v = fill(cache, 0, L, chunk=3)
    assert cache.layer_nbytes(0) == 2 * B * Hkv * (W + 3) * D * 2
    q = mx.random.normal((B, Hkv * G, 3, D))
    sinks = mx.random.normal((Hkv * G,)) if with_sinks else None
    got = attention_any(cache, 0, q, sinks=sinks)
    mask = attention_mask(mx.arange(L), mx.arange(L - 3, L), 0, window=W)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=mask, sinks=sinks)
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()


def test_ring_chunk_written_at_once_sees_its_own_window():
    """M rows written together into a full ring: early rows still see their whole window."""
    B, H, D, W, M = 1, 1, 64, 8, 6
    step = KVCacheManager([LayerSpec(H, D, window=W)], plain("fp16"), max_rows=M)
    chunk = KVCacheManager([LayerSpec(H, D, window=W)], plain("fp16"), max_rows=M)
    k, v = random_kv(B, H, 30, D)
    q = mx.random.normal((B, H, M, D))
    for p in range(24):
        store_kv(step, 0, p, k[:, :, p : p + 1], v[:, :, p : p + 1])
        store_kv(chunk, 0, p, k[:, :, p : p + 1], v[:, :, p : p + 1])
    store_kv(chunk, 0, 24, k[:, :, 24:30], v[:, :, 24:30])
    outs = []
    for m in range(M):
        store_kv(step, 0, 24 + m, k[:, :, 24 + m : 25 + m], v[:, :, 24 + m : 25 + m])
        outs.append(attention_any(step, 0, q[:, :, m : m + 1]))
    assert mx.allclose(attention_any(chunk, 0, q), mx.concatenate(outs, axis=2), atol=1e-3).item()


def test_shared_layer_reads_its_owner():
    specs = [LayerSpec(2, 64), LayerSpec(2, 64, shared_from=0)]
    cache = KVCacheManager(specs, plain("tq4"))
    fill(cache, 0, 10)
    q = mx.random.normal((1, 4, 1, 64))
    assert cache.layer_quant(1) is cache.layer_quant(0)
    assert mx.array_equal(attention_any(cache, 1, q), attention_any(cache, 0, q)).item()
    assert cache.layer_nbytes(0) > 0 and 1 not in cache.owned_layers()


def test_attention_input_errors():
    cache = KVCacheManager([LayerSpec(2, 64)], plain("tq4"))
    fill(cache, 0, 4)
    good = mx.random.normal((1, 4, 1, 64))
    with pytest.raises(ValueError, match="head_dim"):
        attention_any(cache, 0, mx.random.normal((1, 4, 1, 32)))
    with pytest.raises(ValueError, match="multiple"):
        attention_any(cache, 0, mx.random.normal((1, 3, 1, 64)))
    with pytest.raises(ValueError, match="batch size"):
        attention_any(cache, 0, mx.random.normal((2, 4, 1, 64)))
    with pytest.raises(TypeError, match="floating"):
        attention_any(cache, 0, good.astype(mx.int32))
    with pytest.raises(ValueError, match="sinks"):
        attention_any(cache, 0, good, sinks=mx.zeros((2,)))
    with pytest.raises(ValueError, match="committed"):
        attention_any(cache, 0, good, position=4)
    with pytest.raises(ValueError, match="kv_start"):
        attention_any(cache, 0, good, kv_start=4)


def test_tq_reference_key_blocks_change_nothing(monkeypatch):
    """The blocked online softmax equals dense attention, with masks and sinks across block edges."""
    import turbospark_mlx.quant.reference as reference

    B, Hkv, G, D, L, M = 2, 2, 3, 64, 150, 5
    cache = KVCacheManager([LayerSpec(Hkv, D)], plain("k8v3"), batch_size=B, max_rows=L)
    fill(cache, 0, L)
    q = mx.random.normal((B, Hkv * G, M, D))
    sinks = mx.random.normal((Hkv * G,))
    kv_start = mx.array([0, 70])
    k, v = dequantized(cache, 0, L)
    mask = attention_mask(mx.arange(L), mx.arange(L - M, L), kv_start)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=mask, sinks=sinks)
    monkeypatch.setattr(reference, "REF_KEY_BLOCK", 32)
    got = attention_any(cache, 0, q, sinks=sinks, kv_start=kv_start)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize("kv", ["fp16", "tq4", "k8v4"])
def test_store_and_attend_equals_store_then_attend(kv):
    """store_and_attend (the families' write path) gives what store_kv + attention_any give, in
    chunks and one-token steps past the window; bad rows raise the general path's error and
    leave the cache as it was."""
    import copy

    from turbospark_mlx import get_preset, store_and_attend

    config = kv if kv == "fp16" else get_preset(kv).with_(name="p", window_rows=8, sink_rows=2)
    one = KVCacheManager([LayerSpec(2, 32)], config, max_rows=16)
    two = copy.deepcopy(one)
    pos = 0
    for m in (16, 16, 1, 1, 5, 1):
        k, v = random_kv(1, 2, m, 32)
        q = mx.random.normal((1, 4, m, 32))
        got = store_and_attend(one, 0, q, k, v, pos, sinks=mx.ones((4,)))
        store_kv(two, 0, pos, k, v)
        want = attention_any(two, 0, q, pos, sinks=mx.ones((4,)))
        assert mx.array_equal(got, want).item()
        pos += m
    k, v = random_kv(1, 2, 1, 32)
    with pytest.raises(ValueError, match="layer 0: keys .* and values .* differ in shape"):
        store_and_attend(one, 0, mx.zeros((1, 4, 1, 32)), k, v[:, :, :, :16], pos)
    assert one.layer_offset(0) == pos and not one.stage.pending


def test_growing_fp16_step_equals_store_then_attend():
    """A growing FP16 layer's prepared step (`GrowingStep`) writes and attends as store_kv +
    attention_any do: bfloat16 rows into float16 storage, across storage growth, with a start,
    one-token steps and chunks, two sequences; a call the general path refuses (a position that
    is not the next one, rows past max_context, bad queries, a start past the rows) raises its
    error and changes nothing."""
    import copy

    from turbospark_mlx import store_and_attend
    from turbospark_mlx.attention import GrowingStep

    one = KVCacheManager([LayerSpec(2, 32)], "fp16", batch_size=2, max_rows=16, max_context=40, step=8)
    two = copy.deepcopy(one)
    pos = 0
    for m in (5, 1, 1, 9, 1, 16, 1):  # growth at 8, 16, 24 and 40 positions
        k, v = (x.astype(mx.bfloat16) for x in random_kv(2, 2, m, 32))
        q = mx.random.normal((2, 6, m, 32)).astype(mx.bfloat16)
        start = min(3, pos)
        got = store_and_attend(one, 0, q, k, v, pos, scale=0.2, kv_start=start)
        store_kv(two, 0, pos, k, v)
        want = attention_any(two, 0, q, pos, scale=0.2, kv_start=start)
        assert isinstance(one._layers[0].step_plan[1], GrowingStep)
        assert got.dtype == mx.bfloat16 and mx.array_equal(got, want).item()
        pos += m
    for name, a in two.layer_arrays(0).items():
        assert a.dtype == mx.float16 and mx.array_equal(one.layer_arrays(0)[name], a).item()
    before = {n: mx.array(a) for n, a in one.layer_arrays(0).items()}
    k, v = random_kv(2, 2, 1, 32)
    with pytest.raises(ValueError, match="write at position 33, but the layer's next position is 34"):
        store_and_attend(one, 0, mx.zeros((2, 6, 1, 32)), k, v, pos - 1)
    k, v = random_kv(2, 2, 7, 32)
    with pytest.raises(ValueError, match="positions up to 41 exceed max_context=40"):
        store_and_attend(one, 0, mx.zeros((2, 6, 7, 32)), k, v, pos)
    k, v = random_kv(2, 2, 1, 32)
    with pytest.raises(ValueError, match="queries must be a 4-D mx.array"):
        store_and_attend(one, 0, [[0.0]], k, v, pos)
    with pytest.raises(ValueError, match="kv_start 35 is past the first query position 34"):
        store_and_attend(one, 0, mx.zeros((2, 6, 1, 32)), k, v, pos, kv_start=pos + 1)
    assert one.layer_offset(0) == pos
    assert all(mx.array_equal(before[n], a).item() for n, a in one.layer_arrays(0).items())


def test_sliding_ring_step_equals_store_then_attend():
    """A sliding-window FP16 ring's prepared step (`RingStep`) writes and attends as store_kv +
    attention_any do, over the positions its rows read alone: one row and chunks of up to
    max_rows rows (all inside the window: a causal mask; longer: the window's band), while the
    ring grows, once it wraps (the keys in one slice and in two), with a start, with sink logits;
    a refused call changes nothing. A bounded ring with sink rows keeps the general path."""
    import copy

    from turbospark_mlx import store_and_attend
    from turbospark_mlx.attention import RingStep

    W, max_rows = 6, 4  # ring capacity W + max_rows - 1 = 9 slots
    one = KVCacheManager([LayerSpec(2, 32, window=W)], "fp16", max_rows=max_rows, step=4)
    two = copy.deepcopy(one)
    sinks = mx.random.normal((4,)).astype(mx.bfloat16)
    pos = 0
    for m in [3, 2] + [1] * 8 + [4, 3, 1, 2] + [1] * 9 + [4, 4]:
        k, v = (x.astype(mx.bfloat16) for x in random_kv(1, 2, m, 32))
        q = mx.random.normal((1, 4, m, 32)).astype(mx.bfloat16)
        start, sk = (min(2, pos) if pos < 8 else 0), (sinks if pos % 2 else None)
        got = store_and_attend(one, 0, q, k, v, pos, scale=0.3, sinks=sk, kv_start=start)
        store_kv(two, 0, pos, k, v)
        want = attention_any(two, 0, q, pos, scale=0.3, sinks=sk, kv_start=start)
        assert isinstance(one._layers[0].step_plan[1], RingStep)
        assert got.dtype == mx.bfloat16
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 1e-2, pos
        pos += m
    for name, a in two.layer_arrays(0).items():
        assert mx.array_equal(one.layer_arrays(0)[name], a).item()
    # The window read by the step, against the oracle in float32: the last W positions.
    q = mx.random.normal((1, 4, 1, 32))
    k, v = random_kv(1, 2, 1, 32)
    got = store_and_attend(one, 0, q, k, v, pos, scale=0.3)
    ring = one.layer_arrays(0)
    slots = [p % 9 for p in range(pos + 1 - W, pos + 1)]
    keys, values = (mx.take(ring[n], mx.array(slots), axis=2).astype(mx.float32) for n in ("keys", "values"))
    want = fp16_attention_ref(q, keys, values, scale=0.3)
    assert mx.abs(got - want).max().item() < 1e-5
    pos += 1
    before = {n: mx.array(a) for n, a in ring.items()}
    refused = f"write at position {pos - 1}, but the layer's next position is {pos}"
    with pytest.raises(ValueError, match=refused):
        store_and_attend(one, 0, q, k, v, pos - 1)
    with pytest.raises(ValueError, match=f"kv_start {pos + 1} is past the first query position {pos}"):
        store_and_attend(one, 0, q, k, v, pos, kv_start=pos + 1)
    assert one.layer_offset(0) == pos
    assert all(mx.array_equal(before[n], a).item() for n, a in one.layer_arrays(0).items())

    bounded = KVCacheManager([LayerSpec(2, 32)], "fp16", max_rows=max_rows, max_kv_size=8)
    store_and_attend(bounded, 0, q, k, v, 0)
    assert bounded._layers[0].sink_rows and bounded._layers[0].step_plan is None


@pytest.mark.parametrize("kv", ["tq4", "plain-tq4"])
def test_prefill_path_without_a_fused_kernel_goes_in_blocks(kv, monkeypatch):
    """Where MLX has no fused attention for the shape (its CPU backend has none), a prefill
    chunk's rows go in query blocks sized to PREFILL_SCORE_BYTES, one after another: the same
    result as the oracle of the path, on a history decoded by the reference dequantize."""
    from conftest import prefill_reference
    from turbospark_mlx import attention as attention_module

    monkeypatch.setattr(attention_module, "PREFILL_SCORE_BYTES", 4 * 8 * 128 * 24)  # 24 rows at 128 keys
    config = plain("tq4")
    if kv == "tq4":
        config = config.with_(window_rows=16, sink_rows=4, center_keys=True)
    M, D = 48, 64
    cache = KVCacheManager([LayerSpec(2, D)], config, max_rows=M)
    sdpa, calls = mx.fast.scaled_dot_product_attention, []

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], kw.get("force_fused", False)))
        out = sdpa(q, k, v, **kw)  # MLX's CPU backend raises here when the fused kernel is forced
        if kw.get("force_fused"):  # a GPU build that has one: take the block path all the same
            raise ValueError("no fused attention for this shape")
        return out

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    for pos in range(0, 3 * M, M):
        fill_at = random_kv(1, 2, M, D, scale=2.0)
        store_kv(cache, 0, pos, *fill_at)
        q = mx.random.normal((1, 8, M, D))
        out = attention_module._prefill_attention(cache, 0, q, pos, D**-0.5, None, 0, "reference")
        ref = prefill_reference(cache, 0, q, pos)
        if mx.default_device() == mx.cpu:
            assert mx.abs(out - ref).max().item() < 1e-4, pos
        else:  # MLX CUDA's float32 products are less exact than the CPU's: up to 4.5e-3 off here (H100)
            rel = rel_l2(out, ref)
            assert rel < 5e-3, (pos, rel)
        block = max(16, 4 * 8 * 128 * 24 // (4 * 8 * (pos + M)))
        assert calls == [(M, True)] + [(min(block, M - i), False) for i in range(0, M, block)], (pos, calls)
        calls.clear()
