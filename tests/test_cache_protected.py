"""Protected TurboQuant layers: an FP16 window of recent rows, FP16 sink rows and key centring
(preset fields window_rows, sink_rows, center_keys), on the reference backend."""

import json

import mlx.core as mx
import pytest
from conftest import assert_same_state, committed_state, plain

from turbospark_mlx import KVCacheManager, LayerSpec, TurboQuantConfig, attention_any, get_preset, store_kv
from turbospark_mlx.attention import attention_mask
from turbospark_mlx.cache import io as cache_io
from turbospark_mlx.gpu.backend import use_backend
from turbospark_mlx.quant import dequantize_ref
from turbospark_mlx.quant.reference import fp16_attention_ref

B, HKV, G, D = 2, 2, 3, 64


@pytest.fixture(autouse=True)
def _reference_backend_on_the_cpu():
    """These tests hold the reference backend to float32 rounding (1e-5), so they run it on the
    CPU wherever they run; the kernels' own tests (tests/test_gpu_kernels.py) check the GPU."""
    with use_backend("reference"), mx.stream(mx.cpu):
        yield


def protected(window=16, sinks=4, center=True, base="tq4", commit=1) -> TurboQuantConfig:
    return get_preset(base).with_(
        name="p", window_rows=window, sink_rows=sinks, center_keys=center, commit_rows=commit
    )


def data(L, bias=0.0, seed=0):
    mx.random.seed(seed)
    k = mx.random.normal((B, HKV, L, D)) + bias * mx.random.normal((1, HKV, 1, D))
    v = mx.random.normal((B, HKV, L, D))
    q = mx.random.normal((B, HKV * G, L, D))
    return k.astype(mx.float16), v.astype(mx.float16), q


def run(config, k, v, q, chunks, sinks=None, kv_start=0, max_rows=64, max_kv_size=None):
    cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=max_rows, max_kv_size=max_kv_size)
    outs, pos = [], 0
    first = kv_start if isinstance(kv_start, int) else max(kv_start.tolist())  # rows before it attend nothing
    for m in chunks:
        store_kv(cache, 0, pos, k[:, :, pos : pos + m], v[:, :, pos : pos + m])
        s = max(pos, first)
        if s < pos + m:
            outs.append(attention_any(cache, 0, q[:, :, s : pos + m], s, sinks=sinks, kv_start=kv_start))
        pos += m
    return mx.concatenate(outs, axis=2), cache


def oracle(cache, k, v, q, sinks=None):
    """Each query row t over dense keys: FP16 for the sink rows and [committed_end(t + 1), t]
    (the window, and the rows of an unfinished commit block), the stored codes decoded (plus
    the key mean) for the rest."""
    c, S = cache.config, cache.config.sink_rows
    L = k.shape[2]
    a, quant = cache.layer_arrays(0), cache.layer_quant(0)
    q_end = cache.quantized_end(0)
    n = q_end - S  # position p's codes sit in slot p - S
    kq = dequantize_ref(a["k_codes"][:, :, :n], a["k_norms"][:, :, :n], quant.k)
    vq = dequantize_ref(a["v_codes"][:, :, :n], a["v_norms"][:, :, :n], quant.v)
    if c.center_keys and q_end > S:
        kq = kq + a["k_mean"][:, :, None, :]
    rows = []
    for t in range(L):
        use_fp16 = [p < S or p >= c.committed_end(t + 1) for p in range(t + 1)]
        kt = mx.stack([k[:, :, p].astype(mx.float32) if f else kq[:, :, p - S] for p, f in enumerate(use_fp16)], 2)
        vt = mx.stack([v[:, :, p].astype(mx.float32) if f else vq[:, :, p - S] for p, f in enumerate(use_fp16)], 2)
        rows.append(fp16_attention_ref(q[:, :, t : t + 1], kt, vt, scale=D**-0.5, sinks=sinks))
    return mx.concatenate(rows, axis=2)


@pytest.mark.parametrize("config", [protected(), protected(center=False), protected(window=0, center=False),
                                    protected(sinks=0), protected(base="k8v4"), protected(commit=8),
                                    protected(window=0, center=False, commit=5)])
def test_chunked_prefill_equals_token_steps(config):
    L = 150
    k, v, q = data(L, bias=3.0)
    sinks = mx.random.normal((HKV * G,))
    steps, by_steps = run(config, k, v, q, [1] * L, sinks=sinks)
    chunked, by_chunks = run(config, k, v, q, [40, 64, 5, 41], sinks=sinks)
    # The same rows stored bit for bit; attention from the decode-step and the chunk paths
    # (one row's sink and window rows vs a masked tile) equal up to float32 rounding.
    assert_same_state(committed_state(by_steps), committed_state(by_chunks))
    assert mx.allclose(steps, chunked, atol=1e-5, rtol=1e-5).item(), mx.abs(steps - chunked).max().item()


@pytest.mark.parametrize("commit", [1, 4])
def test_matches_oracle_with_sinks_and_centring(commit):
    L = 90
    k, v, q = data(L, bias=3.0)
    sinks = mx.random.normal((HKV * G,))
    got, cache = run(protected(window=8, sinks=3, commit=commit), k, v, q, [30, 1, 59], sinks=sinks)
    want = oracle(cache, k, v, q, sinks=sinks)
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item(), mx.abs(got - want).max().item()


def test_window_and_sinks_covering_everything_are_fp16_attention():
    L = 70
    k, v, q = data(L)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=attention_mask(mx.arange(L), mx.arange(L)))
    for config in (protected(window=L, sinks=0, center=False), protected(window=0, sinks=L, center=False)):
        got, _ = run(config, k, v, q, [64, 6])
        assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item()


def test_centring_and_window_rescue_biased_keys():
    """Keys with a large shared per-channel offset (as biased key projections give): plain 4-bit
    loses most of the attention pattern, the protected layer keeps it."""
    L = 200
    k, v, q = data(L, bias=8.0)
    want = fp16_attention_ref(q, k, v, scale=D**-0.5, mask=attention_mask(mx.arange(L), mx.arange(L)))
    plain_out, _ = run(plain("tq4"), k, v, q, [1] * L)
    prot, _ = run(protected(window=16, sinks=4), k, v, q, [1] * L)
    err_plain = mx.abs(plain_out - want).mean().item()
    err_prot = mx.abs(prot - want).mean().item()
    assert err_prot < 0.5 * err_plain, (err_prot, err_plain)


def test_left_padding_start():
    L = 60
    k, v, q = data(L, bias=2.0)
    starts = mx.array([0, 9])
    steps, _ = run(protected(window=8, sinks=2), k, v, q, [10] + [1] * (L - 10), kv_start=starts)
    chunked, _ = run(protected(window=8, sinks=2), k, v, q, [10, 50], kv_start=starts)
    assert mx.array_equal(steps, chunked).item()


@pytest.mark.parametrize("commit", [1, 8])
def test_save_load_trim_and_bytes(tmp_path, commit):
    L = 120
    k, v, q = data(L, bias=2.0)
    config = protected(commit=commit)
    _, cache = run(config, k, v, q, [64, 56])
    loaded = KVCacheManager.from_file(cache.save(str(tmp_path / "c")))
    qq = mx.random.normal((B, HKV * G, 1, D))
    assert mx.array_equal(attention_any(cache, 0, qq), attention_any(loaded, 0, qq)).item()
    # Trimming and writing the same rows again gives what the cache held before.
    before = attention_any(cache, 0, q[:, :, L - 1 : L], L - 1)
    loaded.trim(30)
    store_kv(loaded, 0, L - 30, k[:, :, L - 30 :], v[:, :, L - 30 :])
    assert mx.array_equal(attention_any(loaded, 0, q[:, :, L - 1 : L], L - 1), before).item()
    with pytest.raises(ValueError, match="FP16 rows"):
        loaded.trim(65)  # more than max_rows = 64 beyond the window
    # The window and sink rows are counted in the cache's bytes.
    unprotected = KVCacheManager([LayerSpec(HKV, D)], plain("tq4"), batch_size=B, max_rows=64)
    store_kv(unprotected, 0, 0, k[:, :, :64], v[:, :, :64])
    store_kv(unprotected, 0, 64, k[:, :, 64:], v[:, :, 64:])
    ring = 16 + commit - 1 + 64  # window, an unfinished commit block, max_rows
    fixed = 2 * B * HKV * (ring + 4) * D * 2 + B * HKV * D * 4  # full ring, sink rows, key mean
    assert cache.nbytes == unprotected.nbytes + fixed


def test_config_fields_validate_and_round_trip():
    with pytest.raises(ValueError, match="window_rows >= 1"):
        get_preset("tq4").with_(window_rows=0, center_keys=True)
    with pytest.raises(ValueError, match=">= 0"):
        get_preset("tq4").with_(sink_rows=-1)
    c = protected()
    assert TurboQuantConfig.from_json(c.to_json()) == c and c.is_protected
    assert not c.plain().is_protected and (c.plain().k_bits, c.plain().name) == (c.k_bits, "p-plain")
    assert not get_preset("fp16").with_(window_rows=8).is_protected


def _tiny_mlx_lm_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_mlx_lm_adapter_serves_protected_presets(tmp_path):
    """The drop-in cache with a window, sink rows and centring: one long call equals token
    steps, prompt-cache files and trim round-trip."""
    from mlx_lm.models.cache import save_prompt_cache, trim_prompt_cache

    from turbospark_mlx.mlx_lm import load_prompt_cache, make_prompt_cache

    model = _tiny_mlx_lm_llama()
    config = protected(window=8, sinks=2)
    prompt = mx.array([[i * 7 % 50 for i in range(70)]])
    whole = make_prompt_cache(model, kv=config, max_rows=8)
    a = model(prompt, cache=whole)
    steps = make_prompt_cache(model, kv=config, max_rows=8)
    b = mx.concatenate([model(prompt[:, i : i + 1], cache=steps) for i in range(70)], axis=1)
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), mx.abs(a - b).max().item()
    save_prompt_cache(str(tmp_path / "c.safetensors"), whole)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    nxt = mx.array([[5]])
    assert mx.array_equal(model(nxt, cache=whole), model(nxt, cache=loaded)).item()
    trim_prompt_cache(whole, 5)
    trim_prompt_cache(loaded, 5)
    assert mx.array_equal(model(nxt, cache=whole), model(nxt, cache=loaded)).item()


def test_mlx_lm_batch_generate_with_the_shipped_presets():
    """mlx_lm.batch_generate on protected presets (window, sinks, centring): prompts of
    different lengths, right-padded in one prefill, each get the tokens they get alone."""
    import mlx_lm
    from test_mlx_lm import TinyTokenizer, greedy, tiny_model

    from turbospark_mlx.mlx_lm import make_prompt_cache, patch_model, unpatch_model

    model = tiny_model("llama")
    tok = TinyTokenizer(97).wrapper
    for kv in ("k8v4", protected()):
        patch_model(model, kv)
        prompts = [list(range(5, 25)), [3, 4], list(range(20, 31))]
        result = mlx_lm.batch_generate(model, tok, prompts, max_tokens=6)
        for p, text in zip(prompts, result.texts):
            assert text == tok.decode(greedy(model, mx.array(p), make_prompt_cache(model, kv), 6)), kv
        unpatch_model(model)


def test_tq4_bytes_at_32k_with_window_and_sinks():
    """At 32k positions and head_dim 128 a shipped-tq4 layer holds under 0.30x the FP16 bytes,
    counting its FP16 ring (window + max_rows rows), sink rows and key mean."""
    cache = KVCacheManager([LayerSpec(1, 128)], "tq4", max_rows=512)
    rows = mx.random.normal((1, 1, 512, 128)).astype(mx.float16)
    for s in range(0, 32768, 512):
        store_kv(cache, 0, s, rows, rows)
    fp16 = 2 * 32768 * 128 * 2
    assert cache.fp16_nbytes() == fp16
    ratio = cache.nbytes / fp16
    print(f"tq4 at 32k: {ratio:.3f}x FP16")
    assert 0.26 < ratio <= 0.30


def test_ring_rows_reads_positions_in_order():
    """Position p of a ring sits in slot p % capacity: ranges that wrap come back as two slices
    joined, in position order, and a range of the whole capacity reads every slot once."""
    from turbospark_mlx.cache.window import ring_rows

    cap = 5
    ring = mx.arange(2 * 3 * cap * 4).reshape(2, 3, cap, 4)
    for p0, p1 in [(0, 5), (2, 4), (3, 7), (5, 10), (9, 12), (12, 13), (4, 9)]:
        want = mx.take(ring, mx.array([p % cap for p in range(p0, p1)]), axis=2)
        got = ring_rows(ring, p0, p1, cap)
        assert got.shape == want.shape and mx.array_equal(got, want).item(), (p0, p1)


def test_uncommitted_write_takes_ring_slots_from_trim():
    """A protected layer's writes go straight into its ring: a write that is never committed
    takes m of the max_rows slots beyond the window, so a trim may then give back only
    max_rows - m positions, and what it keeps reads as before."""
    from turbospark_mlx import kv_write_target

    L = 120
    k, v, q = data(L, bias=2.0)
    _, cache = run(protected(), k, v, q, [64, 56])
    _, shorter = run(protected(), k, v, q, [64, 26])
    kv_write_target(cache, "k", 0, L).write(mx.random.normal((B, HKV, 10, D)).astype(mx.float16))
    with pytest.raises(ValueError, match="10 ring slots hold an uncommitted write"):
        cache.trim(60)
    cache.trim(30)  # 30 <= 64 - 10
    qq = q[:, :, 89:90]
    assert mx.array_equal(attention_any(cache, 0, qq, 89), attention_any(shorter, 0, qq, 89)).item()


def _replay(cache, k, v, q, ops):
    """Apply writes (an int: that many rows) and trims (("trim", n)) to a one-layer cache,
    attending with each write's query rows; returns the outputs of the rows at the end."""
    outs, pos = {}, 0
    for op in ops:
        if isinstance(op, tuple):
            cache.trim(op[1])
            pos -= op[1]
            continue
        store_kv(cache, 0, pos, k[:, :, pos : pos + op], v[:, :, pos : pos + op])
        out = attention_any(cache, 0, q[:, :, pos : pos + op], pos)
        for r in range(op):
            outs[pos + r] = out[:, :, r : r + 1]
        pos += op
    return outs


def _codes_and_window(cache) -> dict:
    """The codes, norms, sink rows and key mean, and the ring's rows the next query reads in
    FP16 (in position order, whatever the ring's modulus)."""
    from turbospark_mlx.cache.window import ring_rows

    a, off = cache.layer_arrays(0), cache.layer_offset(0)
    n = cache.quantized_end(0) - cache.config.sink_rows
    out = {name: a[name][:, :, :n] for name in ("k_codes", "k_norms", "v_codes", "v_norms") if name in a}
    out.update({name: a[name] for name in ("k_sinks", "v_sinks", "k_mean") if name in a})
    lo = max(cache.config.sink_rows, cache.quantized_end(0))
    for side in "kv":
        out[side] = ring_rows(a[f"{side}_recent"], lo, off, cache.recent_capacity(0))
    return out


def test_ring_gives_back_a_chunks_room():
    """A chunk's write takes room for its rows in the FP16 ring (window + unfinished block +
    the chunk), and the next decode step gives it back (window + unfinished block +
    RING_SLACK_ROWS): the layer holds the same codes and window rows, and its attention
    matches one-token steps, across chunks between steps, a trim before a chunk, a file
    round trip and a second trim."""
    from turbospark_mlx.cache.window import RING_SLACK_ROWS

    L = 560
    k, v, q = data(L, bias=2.0)
    config = protected(window=16, sinks=4, commit=4)
    U = config.uncommitted_rows
    ops = [128, 100, *[1] * 30, ("trim", 20), 120, *[1] * 20, 7, *[1] * 10, 128]
    small = U + RING_SLACK_ROWS
    cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=128)
    chunked = _replay(cache, k, v, q, ops)
    end = sum(o if isinstance(o, int) else -o[1] for o in ops)
    assert cache.recent_capacity(0) == U + 128 and cache.layer_arrays(0)["k_recent"].shape[2] == U + 128
    steps_cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=1)
    steps = _replay(steps_cache, k, v, q, [1] * end)
    assert_same_state({0: _codes_and_window(cache)}, {0: _codes_and_window(steps_cache)})
    for t in range(end):
        assert mx.allclose(chunked[t], steps[t], atol=1e-5, rtol=1e-5).item(), t

    one = q[:, :, end : end + 1]
    store_kv(cache, 0, end, k[:, :, end : end + 1], v[:, :, end : end + 1])  # a decode step
    store_kv(steps_cache, 0, end, k[:, :, end : end + 1], v[:, :, end : end + 1])
    assert cache.recent_capacity(0) == small and cache.layer_arrays(0)["k_recent"].shape[2] == small
    assert mx.allclose(attention_any(cache, 0, one, end), attention_any(steps_cache, 0, one, end), atol=1e-5).item()
    end += 1

    path = cache.save(str(_tmp_dir() / "ring.safetensors"))
    loaded = KVCacheManager.from_file(path)
    assert loaded.recent_capacity(0) == small
    # A held position past the offset (written by a bug, the digest re-signed) is refused.
    tensors, meta = mx.load(path, return_metadata=True)
    meta.pop("digest")
    meta["ring_from"] = json.dumps({"0": end + 1})
    meta["digest"] = cache_io.digest(tensors, meta)
    mx.save_safetensors(path, tensors, meta)
    with pytest.raises(ValueError, match="ring.safetensors.*ring_from"):
        KVCacheManager.from_file(path)
    qq = q[:, :, end - 1 : end]
    before = attention_any(cache, 0, qq, end - 1)
    assert mx.array_equal(attention_any(loaded, 0, qq, end - 1), before).item()
    for c in (cache, loaded):
        with pytest.raises(ValueError, match=f"keeps only {RING_SLACK_ROWS} FP16 rows"):
            c.trim(RING_SLACK_ROWS + 1)
        c.trim(40)
        # The ring's slots past the new end hold the trimmed rows until written again, so a
        # second trim may give back only what the first left.
        with pytest.raises(ValueError, match="no longer holds positions"):
            c.trim(RING_SLACK_ROWS - 40 + 1)
        c.trim(RING_SLACK_ROWS - 40)
        p = end - RING_SLACK_ROWS
        store_kv(c, 0, p, k[:, :, p:end], v[:, :, p:end])
        assert mx.array_equal(attention_any(c, 0, qq, end - 1), before).item()


def test_trims_and_a_small_write_after_them_keep_to_the_rows_held():
    """Two trims give back no more than the ring held before the first (its slots past the new
    end hold the trimmed rows until written again); a write that shrinks the ring after a trim
    keeps only rows the ring still held, and a later trim stops there."""
    L = 300
    k, v, q = data(L, bias=2.0)
    config = protected(window=16, sinks=4, commit=4)  # 19 uncommitted rows
    cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=64)  # ring of 83
    _replay(cache, k, v, q, [64, 64, 64])
    cache.trim(30)
    with pytest.raises(ValueError, match="no longer holds positions"):
        cache.trim(35)  # 65 in all, beyond the 64 rows past the window the ring held
    cache.trim(34)
    # A ring given from outside that the offset runs past must hold a decode step's room.
    arrays = dict(cache.layer_arrays(0))
    arrays.update({s: arrays[s][:, :, :50] for s in ("k_recent", "v_recent")})
    with pytest.raises(ValueError, match="needs an FP16 ring of at least 83 slots, 50 given"):
        cache.set_layer_arrays(0, arrays, cache.layer_offset(0))
    assert cache.recent_capacity(0) == 83 and cache.layer_arrays(0)["k_recent"].shape[2] == 83

    cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=128)
    _replay(cache, k, v, q, [128, 128, ("trim", 100), 7])  # the ring of 147 held 109..255
    with pytest.raises(ValueError, match="no longer holds positions"):
        cache.trim(36)  # 163 - 36 - 19 < 109
    cache.trim(35)
    steps = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=1)
    _replay(steps, k, v, q, [1] * 160)
    store_kv(cache, 0, 128, k[:, :, 128:160], v[:, :, 128:160])
    out = attention_any(cache, 0, q[:, :, 159:160], 159)
    assert mx.allclose(out, attention_any(steps, 0, q[:, :, 159:160], 159), atol=1e-5).item()


def _tmp_dir():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


@pytest.mark.parametrize("chunk,prompt", [(8, 24), (96, 96)])
@pytest.mark.parametrize("commit", [1, 4])
def test_cuda_decode_step_bookkeeping_equals_general_path(monkeypatch, commit, chunk, prompt):
    """The CUDA decode step's own path (attention.ProtectedStep) keeps the cache as store_kv
    does: with its kernels replaced by their references on the CPU (the commit quantizes
    the rows leaving the window with quantize_ref; the attention is not computed), the FP16
    ring, sink rows, key mean, codes, norms and offsets after every step equal the general
    path's, across growth of the codes storage (step 16) and wraps of the ring. The kernels
    themselves are checked on the GPU (tests/test_gpu_kernels.py)."""
    import copy

    from turbospark_mlx import attention
    from turbospark_mlx.cache import window
    from turbospark_mlx.cache.window import ring_rows
    from turbospark_mlx.quant.reference import quantize_ref

    def commit_ref(k_ring, v_ring, first, n, quant, ring_capacity, k_mean=None, backend="cuda"):  # tq_commit
        k = ring_rows(k_ring, first, first + n, ring_capacity).astype(mx.float32)
        if k_mean is not None:
            k = k - k_mean[:, :, None]
        v = ring_rows(v_ring, first, first + n, ring_capacity)
        return [*quantize_ref(k, quant.k), *quantize_ref(v, quant.v)]

    class Mma:  # tq_decode_mma: takes every shape; returns zeros of the queries' shape
        reason, per = None, 16

        def launch(self, queries, *codes_rows_and_step):
            return mx.zeros_like(queries)

    config = protected(window=8, sinks=2, commit=commit)
    # A 96-row chunk leaves the ring 96 rows of room, which the first step gives back.
    fast = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=chunk, step=16)
    k, v, q = data(prompt + 96, bias=2.0)
    for p in range(0, prompt, chunk):  # past sink + window rows: codes and a key mean exist
        store_kv(fast, 0, p, k[:, :, p : p + chunk], v[:, :, p : p + chunk])
    general = copy.deepcopy(fast)
    monkeypatch.setattr(window, "tq_commit", commit_ref)
    monkeypatch.setattr(attention, "mma_launch", lambda *a, **kw: Mma())
    monkeypatch.setattr(attention._backend, "current_backend", lambda: "cuda")
    steps = 0
    for p in range(prompt, prompt + 96):
        rows = (k[:, :, p : p + 1], v[:, :, p : p + 1])
        steps += attention._planned_step(fast, 0, q[:, :, :1], *rows, p, None, None, 0) is not None
        attention.store_and_attend(fast, 0, q[:, :, :1], *rows, p)
        with monkeypatch.context() as m:
            m.setattr(attention._backend, "current_backend", lambda: "reference")
            store_kv(general, 0, p, *rows)
        assert fast.layer_offset(0) == general.layer_offset(0) == p + 1
        got, want = fast.layer_arrays(0), general.layer_arrays(0)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].shape == want[name].shape and mx.array_equal(got[name], want[name]).item(), (p, name)
    assert steps == 96  # every step took the own path (the ring is full from position 16 on)
    assert fast.recent_capacity(0) == config.uncommitted_rows + min(chunk, 64)


def test_cuda_decode_step_plan_follows_the_call(monkeypatch):
    """The layer keeps the ProtectedStep of its last call shape (`_Layer.step_plan`): the same
    plan serves every decode step, a copy of the cache shares it, and what changes between
    calls still sends a call to the general path: a second row, a position not at the end, a
    start past the row (an int, or one sequence's of per-sequence starts), a start of another
    type, a trim back into the rows that read no codes, another backend."""
    import copy

    from turbospark_mlx import attention

    class Mma:  # tq_decode_mma: takes every shape (its Python is not under test here)
        reason, per = None, 16

    config = protected(window=8, sinks=2, commit=4)
    cache = KVCacheManager([LayerSpec(HKV, D)], config, batch_size=B, max_rows=32, step=16)
    k, v, q = data(48)
    for p in range(0, 44, 4):  # the ring (window + commit - 1 + max_rows = 43 slots) is full at 43
        store_kv(cache, 0, p, k[:, :, p : p + 4], v[:, :, p : p + 4])
    monkeypatch.setattr(attention, "mma_launch", lambda *a, **kw: Mma())
    monkeypatch.setattr(attention._backend, "current_backend", lambda: "cuda")
    rows = (k[:, :, 44:45], v[:, :, 44:45])

    def step(c, position=44, queries=q[:, :, :1], rows=rows, kv_start=0):
        return attention._planned_step(c, 0, queries, *rows, position, None, None, kv_start)

    first = step(cache)
    assert first is not None and step(cache) is first and cache._layers[0].step_plan[1] is first
    assert step(copy.deepcopy(cache)) is first
    assert step(cache, queries=q[:, :, :1].astype(mx.bfloat16)) is not first  # a new call shape
    assert step(cache) is first
    assert step(cache, queries=q[:, :, :2], rows=(k[:, :, 44:46], v[:, :, 44:46])) is None  # two rows
    assert step(cache, position=43) is None and step(cache, kv_start=45) is None
    per_sequence = step(cache, kv_start=mx.array([0, 44]))  # one start per sequence: its own shape
    assert per_sequence is not None and per_sequence is not first
    assert step(cache, kv_start=mx.array([0, 45])) is None  # a start past the row
    assert step(cache, kv_start=0.0) is None  # not an int or an array: the general path names it
    with monkeypatch.context() as m:
        m.setattr(attention._backend, "current_backend", lambda: "reference")
        assert step(cache) is None
    assert step(cache) is first
    first_read = config.window_rows + config.sink_rows + config.commit_rows  # rows before it read no codes
    cache.trim(44 - first_read + 1)
    assert step(cache, position=cache.layer_offset(0)) is None  # its row would read no codes
