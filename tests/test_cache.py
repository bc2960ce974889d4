"""KVCacheManager: layout, chunked writes, bytes, trim, save/load and bad input."""

import copy
import re

import mlx.core as mx
import pytest

from conftest import assert_same_state, committed_state, plain, random_kv
from turbospark_mlx import (
    PRESETS,
    KVCacheManager,
    LayerSpec,
    TurboQuantConfig,
    attention_any,
    commit_kv,
    get_preset,
    kv_write_target,
    store_kv,
)

SPECS = [LayerSpec(2, 128), LayerSpec(2, 128, window=16), LayerSpec(2, 96), LayerSpec(2, 96, shared_from=2)]


def make(kv="tq4", **kw):
    kw.setdefault("max_rows", 64)
    return KVCacheManager(SPECS, kv, **kw)


def write_all(cache, k, v, chunk):
    """Write positions [offset, offset + L) of every owning layer in chunks of `chunk` rows."""
    start = cache.offset
    L = k[0].shape[2]
    for s in range(0, L, chunk):
        for i, spec in enumerate(cache.specs):
            if spec.shared_from is None:
                store_kv(cache, i, start + s, k[i][:, :, s : s + chunk], v[i][:, :, s : s + chunk])


def random_layers(B, L):
    kv = [random_kv(B, s.n_kv_heads, L, s.head_dim, scale=3.0) for s in SPECS]
    return [k for k, _ in kv], [v for _, v in kv]


def test_layout_and_policy():
    cache = make("tq4")
    assert cache.layer_quant(0) is not None and cache.layer_quant(2) is not None
    assert cache.layer_quant(1) is None and cache.ring_capacity(1) == 16 + 63
    assert cache.layer_quant(3) is cache.layer_quant(2)
    assert set(cache.quant_tables()) == {0, 2}
    q = cache.layer_quant(0)
    assert (q.k.bits, q.v.bits, q.k.head_dim, q.k.rotation.kind) == (4, 4, 128, "hadamard")
    assert cache.layer_quant(2).k.rotation.kind == "dense"
    assert make("fp16").quant_tables() == {}
    policy = TurboQuantConfig("edge", 4, 4, fp16_first=1)
    assert set(make(policy).quant_tables()) == {2}
    assert "turboquant k4v4" in cache.summary() and "ring" in cache.summary() and "shared -> 2" in cache.summary()


@pytest.mark.parametrize("kv", ["tq4", "tq3", "k8v3", "fp16"])
@pytest.mark.parametrize("B", [1, 3])
def test_chunked_writes_are_bit_exact(kv, B):
    """M = 1, 7 and 64-row writes give the same cache as one row at a time."""
    k, v = random_layers(B, 130)
    ref = make(kv, batch_size=B)
    write_all(ref, k, v, 1)
    for chunk in (7, 64):
        got = make(kv, batch_size=B)
        write_all(got, k, v, chunk)
        assert_same_state(committed_state(ref), committed_state(got))
        # Ring slots hold the same positions too.
        assert mx.array_equal(got.layer_arrays(1)["keys"], ref.layer_arrays(1)["keys"]).item()


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("B", [1, 2])
def test_nbytes_matches_preset_formula(name, B):
    preset = plain(name)  # codes only; tests/test_cache_protected.py counts the FP16 window
    cache = make(preset, batch_size=B, step=256)
    k, v = random_layers(B, 300)
    write_all(cache, k, v, 64)
    cap = 512  # 300 positions in whole steps of 256
    expect = 0
    for i in (0, 2):
        d = SPECS[i].head_dim
        expect += B * 2 * cap * preset.bytes_per_token(d)
    expect += B * 2 * (16 + 63) * 128 * 2 * 2  # the ring stays at window + max_rows - 1
    assert cache.nbytes == expect


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_bytes_in_use_count_each_position_once_as_stored(B, dtype):
    """bytes_in_use: each position a query reads, as codes + norms or as uncompressed rows (sinks,
    window, an unfinished commit block), plus the key means; a sliding ring counts its window;
    and the same positions as rows of the cache's dtype."""
    W, S, C, L = 16, 4, 8, 303  # 280 positions coded, 3 of a block left in FP16
    config = get_preset("k8v4").with_(window_rows=W, sink_rows=S, commit_rows=C)
    cache = make(config, batch_size=B, dtype=dtype)
    k, v = random_layers(B, L)
    write_all(cache, k, v, 64)
    size = dtype.size
    coded = (L - S - W) // C * C  # whole commit blocks past the sinks and the window
    fp16_rows = L - coded
    want, full = 0, 0
    for d, rows in ((128, L), (128, 16), (96, L)):  # layers 0, 1 (a 16-row ring), 2; 3 shares 2
        full += B * 2 * 2 * rows * d * size
    for d in (128, 96):  # the compressed layers: 8-bit keys, 4-bit values, a float32 norm each
        want += B * 2 * (coded * (d + d // 2 + 8) + fp16_rows * 2 * d * size + d * 4)
    want += B * 2 * 2 * 16 * 128 * size
    assert cache.bytes_in_use() == (want, full)
    fp16 = make("fp16", batch_size=B, dtype=dtype)
    write_all(fp16, k, v, 64)
    assert fp16.bytes_in_use() == (full, full) and full < fp16.nbytes
    tq = make(plain("tq4"), batch_size=B, dtype=dtype)
    write_all(tq, k, v, 1)
    per_token = PRESETS["tq4"].bytes_per_token(128) + PRESETS["tq4"].bytes_per_token(96)
    assert tq.bytes_in_use()[0] == B * 2 * L * per_token + B * 2 * 2 * 16 * 128 * size


def test_bytes_per_token_and_ratios():
    assert PRESETS["fp16"].bytes_per_token(128) == 512
    assert PRESETS["tq4"].bytes_per_token(128) == 2 * (64 + 4)
    assert PRESETS["tq3"].bytes_per_token(128) == 2 * (48 + 4)
    assert PRESETS["tq2"].bytes_per_token(128) == 2 * (32 + 4)
    assert PRESETS["k8v4"].bytes_per_token(128) == (128 + 4) + (64 + 4)
    assert PRESETS["k4v3"].bytes_per_token(96) == (48 + 4) + (36 + 4)
    assert PRESETS["tq4"].ratio_vs_fp16(128) <= 0.27
    assert PRESETS["tq3"].ratio_vs_fp16(128) <= 0.21


def test_storage_grows_in_steps():
    cache = make(plain("tq4"), step=32)
    k, v = random_layers(1, 40)
    write_all(cache, k[:1] * 0 + k, v, 1)
    codes = cache.layer_arrays(0)["k_codes"]
    assert codes.shape[2] == 64 and cache.layer_offset(0) == 40


def test_trim_and_rewrite():
    k, v = random_layers(1, 50)
    a = make(plain("tq3"))
    write_all(a, k, v, 10)
    assert a.trim(5) == 5 and a.offset == 45
    k2, v2 = random_layers(1, 5)
    write_all(a, k2, v2, 5)
    b = make(plain("tq3"))
    write_all(b, [x[:, :, :45] for x in k], [x[:, :, :45] for x in v], 45)
    write_all(b, k2, v2, 5)
    for i in (0, 2):
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            assert mx.array_equal(a.layer_arrays(i)[name][:, :, :50], b.layer_arrays(i)[name][:, :, :50]).item()
    q = mx.random.normal((1, 2, 1, 128))
    assert mx.allclose(attention_any(a, 1, q), attention_any(b, 1, q), atol=1e-4).item()


def test_save_load_roundtrip_bit_exact(tmp_path):
    k, v = random_layers(2, 77)
    cache = make("k8v3", batch_size=2)
    write_all(cache, k, v, 11)
    path = cache.save(str(tmp_path / "kv"))
    loaded = KVCacheManager.from_file(path)
    assert loaded.config == cache.config and loaded.specs == cache.specs
    assert_same_state(committed_state(cache), committed_state(loaded))
    for i in (0, 1, 2):
        for name, a in cache.layer_arrays(i).items():
            assert mx.array_equal(a, loaded.layer_arrays(i)[name]).item()
    # A loaded cache continues exactly like the original.
    k2, v2 = random_layers(2, 3)
    write_all(cache, k2, v2, 3)
    write_all(loaded, k2, v2, 3)
    q = mx.random.normal((2, 4, 1, 96))
    assert mx.array_equal(attention_any(cache, 3, q), attention_any(loaded, 3, q)).item()


def test_deepcopy_is_independent():
    k, v = random_layers(1, 20)
    cache = make("tq4")
    write_all(cache, k, v, 20)
    before = committed_state(cache)
    clone = copy.deepcopy(cache)
    k2, v2 = random_layers(1, 4)
    write_all(clone, k2, v2, 4)
    assert clone.offset == 24
    assert_same_state(before, committed_state(cache))


# -- bad input: a clear error, and the cache as it was ----------------------


@pytest.fixture
def filled():
    cache = make("tq4", batch_size=2, max_rows=8, max_context=100)
    k, v = random_layers(2, 24)
    write_all(cache, k, v, 8)
    return cache


@pytest.mark.parametrize(
    "shape,dtype,match",
    [
        ((2, 2, 1, 64), mx.float16, "head_dim"),
        ((2, 3, 1, 128), mx.float16, "KV heads"),
        ((3, 2, 1, 128), mx.float16, "batch size"),
        ((2, 2, 1, 128), mx.int32, "floating"),
        ((2, 2, 9, 128), mx.float16, "max_rows"),
    ],
)
@pytest.mark.parametrize("layer", [0, 1])
def test_bad_writes_leave_cache_unchanged(filled, shape, dtype, match, layer):
    before = committed_state(filled)
    nbytes = filled.nbytes
    good = mx.zeros((2, 2, 1, 128), dtype=mx.float16)
    bad = mx.ones(shape).astype(dtype)
    with pytest.raises((ValueError, TypeError), match=match):
        store_kv(filled, layer, 24, bad, bad)
    assert not filled.stage.pending
    # Through the targets: a good K, then a bad V, then a commit that must refuse.
    kv_write_target(filled, "k", layer, 24).write(good)
    with pytest.raises((ValueError, TypeError), match=match):
        kv_write_target(filled, "v", layer, 24).write(bad)
    with pytest.raises(ValueError, match="without matching V rows"):
        commit_kv(filled, layer, 24, 1)
    assert_same_state(before, committed_state(filled))
    assert filled.nbytes == nbytes


def test_write_past_ring_capacity_is_refused(filled):
    before = committed_state(filled)
    rows = mx.zeros((2, 2, 9, 128), dtype=mx.float16)
    with pytest.raises(ValueError, match="ring capacity"):
        kv_write_target(filled, "k", 1, 24).write(rows)
    assert_same_state(before, committed_state(filled))


def test_other_bad_writes(filled):
    before = committed_state(filled)
    row = mx.zeros((2, 2, 1, 128), dtype=mx.float16)
    with pytest.raises(ValueError, match="next position is 24"):
        store_kv(filled, 0, 20, row, row)
    with pytest.raises(ValueError, match="owns no storage"):
        store_kv(filled, 3, 24, row[..., :96], row[..., :96])
    with pytest.raises(ValueError, match="max_context"):
        big = KVCacheManager([LayerSpec(2, 128)], "tq4", batch_size=2, max_context=24)
        store_kv(big, 0, 0, mx.zeros((2, 2, 25, 128)), mx.zeros((2, 2, 25, 128)))
    with pytest.raises(ValueError, match="without matching V rows"):
        kv_write_target(filled, "k", 0, 24).write(row)
        commit_kv(filled, 0, 24, 1)
    with pytest.raises(ValueError, match="side"):
        kv_write_target(filled, "q", 0, 24)
    filled.stage.pending.clear()
    assert_same_state(before, committed_state(filled))


def test_trim_errors_leave_cache_unchanged(filled):
    before = committed_state(filled)
    with pytest.raises(ValueError, match="holds only 24"):
        filled.trim(25)
    with pytest.raises(ValueError, match="non-negative"):
        filled.trim(-1)
    # The ring (window 16, max_rows 8) keeps 8 positions beyond its window.
    more_k, more_v = random_layers(2, 40)
    write_all(filled, more_k, more_v, 8)
    before = committed_state(filled)
    with pytest.raises(ValueError, match="beyond its window"):
        filled.trim(9)
    assert_same_state(before, committed_state(filled))
    assert filled.trim(8) == 8


def test_preset_strings_turn_protection_off_and_change_fields():
    plain = get_preset("tq4-plain")
    assert plain == get_preset("tq4").plain() and not plain.is_protected and plain.name == "tq4-plain"
    c = get_preset("k8v4:seed=1:sink_rows=0:center_keys=false")
    assert (c.name, c.k_bits, c.v_bits, c.seed, c.sink_rows, c.center_keys, c.window_rows) == (
        "k8v4:seed=1:sink_rows=0:center_keys=false", 8, 4, 1, 0, False, 128
    )
    assert get_preset("tq4-plain:k_bits=3").k_bits == 3 and get_preset("fp16-plain") == get_preset("fp16")
    for text, message in [
        ("tq5:seed=1", "unknown KV preset 'tq5'"),
        ("tq4:foo=1", "'foo=1' is not field=value with a field from k_bits"),
        ("tq4:window_rows", "'window_rows' is not field=value"),
        ("tq4:window_rows=x", "window_rows='x' is not a valid value"),
        ("tq4:center_keys=maybe", "center_keys='maybe' is not a valid value"),
        ("tq4:window_rows=0", "needs window_rows >= 1"),  # centred keys without a window
        ("tq4:k_bits=5", "k_bits=5 is not supported"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            get_preset(text)


def test_bad_presets_and_layouts():
    with pytest.raises(ValueError, match="valid presets: fp16, tq4, tq3, tq2, k4v3, k8v4, k8v3"):
        get_preset("tq5")
    with pytest.raises(ValueError, match="not supported"):
        TurboQuantConfig("x", 5, 4)
    with pytest.raises(ValueError, match="not supported"):
        TurboQuantConfig("x", 16, 4)
    with pytest.raises(ValueError, match="sliding-window"):
        KVCacheManager(SPECS, TurboQuantConfig("x", 4, 4, quantize_layers=(0, 1)))
    with pytest.raises(ValueError, match="owner must be an earlier layer"):
        KVCacheManager([LayerSpec(2, 64, shared_from=1), LayerSpec(2, 64)])
    with pytest.raises(ValueError, match="head_dim must be at least 8"):
        KVCacheManager([LayerSpec(2, 4)], "tq4")


def _damaged(path, tmp_path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) - 100]
    elif how == "flip":
        data[-10] ^= 0x01
    elif how == "meta":
        i = data.find(b'"offsets"')
        j = data.find(b"24", i)
        data[j : j + 2] = b"23"
    out = tmp_path / f"{how}.safetensors"
    out.write_bytes(bytes(data))
    return str(out)


@pytest.mark.parametrize("how", ["truncate", "flip", "meta"])
def test_damaged_files_are_refused_and_cache_unchanged(filled, tmp_path, how):
    path = filled.save(str(tmp_path / "kv"))
    other = make("tq4", batch_size=2, max_rows=8, max_context=100)
    k, v = random_layers(2, 8)
    write_all(other, k, v, 8)
    before = committed_state(other)
    with pytest.raises(ValueError, match="cannot read|corrupted|invalid"):
        other.load_state(_damaged(path, tmp_path, how))
    assert_same_state(before, committed_state(other))
    other.load_state(path)
    assert_same_state(committed_state(filled), committed_state(other))


def test_load_refuses_other_layout(filled, tmp_path):
    path = filled.save(str(tmp_path / "kv"))
    other = make("tq3", batch_size=2, max_rows=8)
    with pytest.raises(ValueError, match="different preset"):
        other.load_state(path)


def test_interrupted_save_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """Saves go to a temporary file that replaces the target only once written: a save that
    fails half-way leaves the previous file intact and no temporary file behind."""
    from turbospark_mlx.cache import io

    cache = make(plain("tq4"))
    k, v = random_layers(1, 20)
    write_all(cache, k, v, 20)
    path = cache.save(str(tmp_path / "kv.safetensors"))
    before = open(path, "rb").read()
    real = mx.save_safetensors

    def interrupted(file, tensors, metadata=None):
        real(file, tensors, metadata=metadata)
        with open(file, "r+b") as f:
            f.truncate(100)  # a partial write ...
        raise KeyboardInterrupt  # ... then the process is interrupted

    monkeypatch.setattr(io.mx, "save_safetensors", interrupted)
    write_all(cache, *random_layers(1, 5), 5)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    assert open(path, "rb").read() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.safetensors"]
    KVCacheManager.from_file(path)  # still loads


def test_a_preset_measured_to_lose_quality_warns():
    """tq2 (measured in benchmarks/results/quality.md) warns when a cache is built with it or a
    string variant with its bits, the mlx-lm drop-in included; other presets, other bits and a
    config derived in Python do not."""
    import warnings

    from turbospark_mlx.quant.config import QUALITY_WARNINGS

    assert set(QUALITY_WARNINGS) <= set(PRESETS)
    with pytest.warns(UserWarning, match="KV preset 'tq2': .*quality.md"):
        KVCacheManager([LayerSpec(2, 64)], "tq2")
    for variant in ("tq2-plain", "tq2:seed=1"):
        with pytest.warns(UserWarning, match=f"KV preset '{variant}': "):
            KVCacheManager([LayerSpec(2, 64)], variant)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVCacheManager([LayerSpec(2, 64)], "k8v4")
        KVCacheManager([LayerSpec(2, 64)], "tq2:k_bits=3")
        KVCacheManager([LayerSpec(2, 64)], PRESETS["tq2"].with_(window_rows=256))
