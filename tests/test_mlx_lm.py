"""The drop-in cache for stock mlx-lm models (tiny random llama, qwen3, gemma3_text, gpt_oss)."""

import copy
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import plain, rel_l2

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from turbospark_mlx import TurboQuantConfig, get_preset  # noqa: E402
from turbospark_mlx.mlx_lm import (  # noqa: E402
    TurboSparkBatchKVCache,
    TurboSparkKVCache,
    load_prompt_cache,
    make_prompt_cache,
    patch_model,
    unpatch_model,
)

K8V8 = TurboQuantConfig("k8v8", 8, 8)  # near-lossless: checks the path, not the codec


def tiny_model(family: str, seed: int = 0):
    """A tiny random mlx-lm model of `family` (float32 weights)."""
    mx.random.seed(seed)
    common = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=97
    )
    if family == "llama":
        from mlx_lm.models import llama as mod

        args = mod.ModelArgs(
            model_type="llama", num_hidden_layers=3, rms_norm_eps=1e-5, head_dim=32, **common
        )
    elif family == "qwen3":
        from mlx_lm.models import qwen3 as mod

        args = mod.ModelArgs(
            model_type="qwen3", num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=512,
            head_dim=32, tie_word_embeddings=True, rope_theta=10000.0, **common,
        )  # fmt: skip
    elif family == "gemma3_text":
        from mlx_lm.models import gemma3_text as mod

        args = mod.ModelArgs(
            model_type="gemma3_text", num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=8, sliding_window_pattern=2, **common,
        )  # fmt: skip
    elif family == "gpt_oss":
        from mlx_lm.models import gpt_oss as mod

        args = mod.ModelArgs(
            num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], **{**common, "intermediate_size": 64},
        )  # fmt: skip
    else:
        raise ValueError(family)
    model = mod.Model(args)
    if family == "gpt_oss":  # non-zero sinks so that they matter
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal((4,))
    mx.eval(model.parameters())
    return model


FAMILIES = ["llama", "qwen3", "gemma3_text", "gpt_oss"]


def forward_chunks(model, tokens, cache, chunk):
    outs = [model(tokens[:, s : s + chunk], cache=cache) for s in range(0, tokens.shape[1], chunk)]
    return mx.concatenate(outs, axis=1)


def greedy(model, prompt, cache, n, **kw):
    return [
        t
        for t, _ in zip((tok for tok, _ in generate_step(prompt, model, prompt_cache=cache, **kw)), range(n))
    ]


class TinyTokenizer:
    """Enough of a tokenizer for mlx_lm.generate / stream_generate / batch_generate."""

    def __init__(self, vocab):
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper

        class _Tok:
            eos_token_id = None
            bos_token = None
            chat_template = None
            vocab_size = vocab
            clean_up_tokenization_spaces = False

            def encode(self, text, add_special_tokens=True):
                return [ord(c) % vocab for c in text]

            def decode(self, ids, **kw):
                return "".join(chr(65 + i % 26) for i in ids)

            def get_vocab(self):
                return {chr(i): i for i in range(vocab)}

            def apply_chat_template(self, messages, **kw):
                raise NotImplementedError("no chat template")

        self.wrapper = TokenizerWrapper(_Tok(), NaiveStreamingDetokenizer, eos_token_ids=[])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_mlx_lm_cache(family):
    """Chunked prefill + decode through our cache vs mlx-lm's own cache, same random weights."""
    model = tiny_model(family)
    tokens = mx.random.randint(0, 97, (1, 29))
    ref = forward_chunks(model, tokens, mlx_cache.make_prompt_cache(model), 29)
    errs = {}
    for kv in (K8V8, "k8v4"):
        cache = make_prompt_cache(model, kv)
        assert any(isinstance(c, TurboSparkKVCache) for c in cache)
        # 7-token chunks exercise offset > 0 prefill; the last 3 tokens one by one are decode steps.
        ours = mx.concatenate(
            [
                forward_chunks(model, tokens[:, :26], cache, 7),
                forward_chunks(model, tokens[:, 26:], cache, 1),
            ],
            axis=1,
        )
        errs[getattr(kv, "name", kv)] = rel_l2(ours, ref)
        assert all(c.offset == 29 for c in cache if hasattr(c, "offset"))
    unpatch_model(model)
    # Relative Frobenius error of all logits (measured: k8v8 ~0.005-0.01, k8v4 ~0.04-0.07).
    print(family, errs)
    assert errs["k8v8"] < 0.03, errs
    assert errs["k8v4"] < 0.2, errs


def test_rows_stay_in_the_keys_dtype():
    """The drop-in keeps uncompressed rows in the dtype the keys come in, as mlx-lm's KVCache
    does (float32 for a float32 model, bfloat16 for a bfloat16 one); a dtype it cannot store
    is refused when the cache is made."""
    for dtype in (mx.float32, mx.bfloat16):
        model = tiny_model("llama")
        model.set_dtype(dtype)
        cache = make_prompt_cache(model, "k8v4")
        model(mx.random.randint(0, 97, (1, 5)), cache=cache)
        manager = cache[0]._kv
        assert manager.dtype == dtype
        assert manager.layer_arrays(0)["k_recent"].dtype == dtype
        unpatch_model(model)
    with pytest.raises(ValueError, match="dtype must be one of"):
        TurboSparkKVCache("k8v4", dtype="float64")


def test_sliding_layers_keep_mlx_lm_caches():
    model = tiny_model("gemma3_text")
    cache = make_prompt_cache(model, "tq4")
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["RotatingKVCache", "TurboSparkKVCache"] * 2
    policy = TurboQuantConfig("edge", 4, 4, fp16_last=1)
    assert type(make_prompt_cache(model, policy)[3]) is mlx_cache.KVCache  # the preset's layer policy
    unpatch_model(model)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_generate_step_chunked_prefill_matches_single_prefill(family):
    model = tiny_model(family)
    prompt = mx.random.randint(0, 97, (21,))
    ref = greedy(model, prompt, mlx_cache.make_prompt_cache(model), 8)
    a = greedy(model, prompt, make_prompt_cache(model, K8V8), 8, prefill_step_size=5)
    b = greedy(model, prompt, make_prompt_cache(model, K8V8), 8, prefill_step_size=64)
    unpatch_model(model)
    assert a == b
    assert a == ref  # k8v8 is close enough for the same greedy tokens on these weights


def test_generate_and_stream_generate_run():
    model = tiny_model("qwen3")
    tok = TinyTokenizer(97).wrapper
    cache = make_prompt_cache(model, "tq4")
    text = mlx_lm.generate(model, tok, "hello world", max_tokens=6, prompt_cache=cache)
    assert len(text) == 6
    cache = make_prompt_cache(model, "tq4")
    out = list(mlx_lm.stream_generate(model, tok, "hello world", max_tokens=5, prompt_cache=cache))
    theirs = mlx_cache.make_prompt_cache(model)
    list(mlx_lm.stream_generate(model, tok, "hello world", max_tokens=5, prompt_cache=theirs))
    assert len(out) == 5 and cache[0].offset == theirs[0].offset == 16  # 11 prompt + 5 (one computed ahead)
    unpatch_model(model)


def test_speculative_decoding_trims_and_matches_greedy():
    model, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    from mlx_lm.generate import speculative_generate_step

    prompt = mx.random.randint(0, 97, (12,))
    want = greedy(model, prompt, make_prompt_cache(model, K8V8), 10)
    cache = make_prompt_cache(model, K8V8) + make_prompt_cache(draft, K8V8)
    trims = []
    orig_trim = TurboSparkKVCache.trim
    TurboSparkKVCache.trim = lambda self, n: trims.append(n) or orig_trim(self, n)
    try:
        gen = speculative_generate_step(prompt, model, draft, prompt_cache=cache, num_draft_tokens=3)
        got = [(t, d) for (t, _, d), _ in zip(gen, range(10))]
    finally:
        TurboSparkKVCache.trim = orig_trim
    unpatch_model(model), unpatch_model(draft)
    assert [t for t, _ in got] == want
    assert any(n > 0 for n in trims)  # the random draft is rejected, so caches were rewound


def test_trim_then_continue_equals_fresh():
    model = tiny_model("llama")
    tokens = mx.random.randint(0, 97, (1, 20))
    cache = make_prompt_cache(model, "tq4")
    model(tokens, cache=cache)
    assert mlx_cache.can_trim_prompt_cache(cache)
    assert mlx_cache.trim_prompt_cache(cache, 6) == 6
    assert cache[0].offset == 14
    cont = model(tokens[:, 14:17], cache=cache)
    fresh = make_prompt_cache(model, "tq4")
    model(tokens[:, :14], cache=fresh)
    assert mx.allclose(cont, model(tokens[:, 14:17], cache=fresh), atol=1e-5).item()
    assert cache[0].trim(100) == 17 and cache[0].offset == 0  # clamped like KVCache.trim
    unpatch_model(model)


def test_deepcopy_is_independent():
    model = tiny_model("llama")
    tokens = mx.random.randint(0, 97, (1, 12))
    cache = make_prompt_cache(model, "k8v4")
    model(tokens[:, :10], cache=cache)
    snap = copy.deepcopy(cache)
    a = model(tokens[:, 10:], cache=cache)
    b = model(tokens[:, 10:], cache=snap)
    assert mx.array_equal(a, b).item()
    assert snap[0].offset == cache[0].offset == 12
    unpatch_model(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_save_load_round_trip_continues_identically(tmp_path, family):
    model = tiny_model(family)
    prompt = mx.random.randint(0, 97, (14,))
    cache = make_prompt_cache(model, "k8v4")
    model(prompt[None, :-1], cache=cache)
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, cache, {"note": "x"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "x"
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for a, b in zip(cache, loaded):
        assert a.offset == b.offset
        if isinstance(a, TurboSparkKVCache):
            assert a.nbytes == b.nbytes and a.config == b.config
            for x, y in zip(a.state[:4], b.state[:4]):  # codes are None while every row is in the window
                assert (x is None and y is None) or mx.array_equal(x, y).item()
    want = greedy(model, prompt[-1:], copy.deepcopy(cache), 6)
    assert greedy(model, prompt[-1:], loaded, 6) == want
    unpatch_model(model)


def test_empty_cache_round_trip(tmp_path):
    if "meta_state" in vars(mlx_cache._BaseCache):
        pytest.skip("mlx-lm 0.31.x cannot save an empty cache list, not even its own KVCache")
    model = tiny_model("llama")
    cache = make_prompt_cache(model, "tq4")
    path = str(tmp_path / "empty.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(c.offset == 0 and c.empty() for c in loaded)
    unpatch_model(model)


def test_batch_generate_matches_single_sequences():
    model = tiny_model("llama")
    tok = TinyTokenizer(97).wrapper
    patch_model(model, K8V8)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23]]
    result = mlx_lm.batch_generate(model, tok, prompts, max_tokens=5, return_prompt_caches=True)
    for p, text, caches in zip(prompts, result.texts, result.caches):
        single = greedy(model, mx.array(p), make_prompt_cache(model, K8V8), 5)
        assert text == tok.decode(single)
        assert isinstance(caches[0], TurboSparkKVCache)
    unpatch_model(model)


def test_batch_cache_merge_filter_extend_extract():
    model = tiny_model("llama")
    seqs = [mx.random.randint(0, 97, (1, n)) for n in (9, 4, 6)]
    singles = []
    for s in seqs:
        c = make_prompt_cache(model, plain("k8v4"))  # the batch cache merges plain layers only
        model(s, cache=c)
        singles.append(c)
    batch = [TurboSparkKVCache.merge([c[i] for c in singles]) for i in range(3)]
    assert isinstance(batch[0], TurboSparkBatchKVCache) and batch[0].offset.tolist() == [9, 4, 6]
    nxt = mx.array([[1], [2], [3]])
    logits = model(nxt, cache=batch)[:, -1]
    for b, (s, c) in enumerate(zip(seqs, singles)):
        assert c[0].offset == s.shape[1]  # merge copied: the single caches are unchanged
        one = model(nxt[b : b + 1], cache=copy.deepcopy(c))[:, -1]
        assert mx.array_equal(logits[b : b + 1], one).item(), b
    ex = batch[0].extract(1)
    assert ex.offset == 5 and ex.nbytes > 0
    for c in batch:
        c.filter([0, 2])
    assert batch[0].offset.tolist() == [10, 7]
    extra = [TurboSparkKVCache.merge([singles[1][i]]) for i in range(3)]
    for c, e in zip(batch, extra):
        c.extend(e)
    assert batch[0].offset.tolist() == [10, 7, 4] and batch[0].size() == 10
    assert batch[0].trim(2) == 2 and batch[0].offset.tolist() == [8, 5, 2]
    unpatch_model(model)


def test_unconverted_attention_and_unsupported_family_fail_clearly():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, "tq4")
    unpatch_model(model)
    with pytest.raises(RuntimeError, match="never hands out an FP16 copy"):
        model(mx.array([[1, 2]]), cache=cache)
    import mlx.nn as nn

    class Odd(nn.Module):
        def __call__(self, x, mask=None, cache=None):
            return x

    model.layers[1].self_attn = Odd()
    with pytest.raises(NotImplementedError, match="cannot serve"):
        make_prompt_cache(model, "tq4")
    assert not any(hasattr(type(l.self_attn), "_turbospark_original") for l in model.layers)  # left unchanged


def test_unpatch_restores_mlx_lm_behaviour():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 97, (10,))
    before = greedy(model, prompt, None, 6)
    classes = [type(l.self_attn) for l in model.layers]
    patch_model(model, "tq4")
    assert all(isinstance(c, TurboSparkKVCache) for c in mlx_cache.make_prompt_cache(model))
    greedy(model, prompt, None, 3)
    unpatch_model(model)
    assert [type(l.self_attn) for l in model.layers] == classes
    assert "make_cache" not in vars(model)
    assert all(type(c) is mlx_cache.KVCache for c in mlx_cache.make_prompt_cache(model))
    assert greedy(model, prompt, None, 6) == before


def test_import_patches_nothing(tmp_path):
    """A fresh process: importing turbospark_mlx (and .mlx_lm) leaves every mlx-lm module as it was."""
    code = r"""
import json, sys, importlib
import mlx_lm, mlx_lm.generate
mods = ["mlx_lm.models.cache", "mlx_lm.models.base", "mlx_lm.models.llama", "mlx_lm.models.gpt_oss"]
for m in mods: importlib.import_module(m)
snap = lambda: {m: {k: id(v) for k, v in vars(sys.modules[m]).items()} for m in mods + ["mlx_lm.generate"]}
before = snap()
import turbospark_mlx, turbospark_mlx.mlx_lm
after = snap()
print(json.dumps(before == after))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is True
    # And an unregistered file fails in mlx-lm's loader until the user calls into turbospark_mlx.
    model = tiny_model("llama")
    cache = make_prompt_cache(model, "tq4")
    model(mx.array([[1, 2, 3]]), cache=cache)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    unpatch_model(model)
    code = f"""
import mlx_lm.models.cache as c, turbospark_mlx.mlx_lm as t
try:
    c.load_prompt_cache({path!r}); print("loaded")
except KeyError as e:
    print("keyerror", e)
print(t.load_prompt_cache({path!r})[0].offset)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["keyerror", "'TurboSparkKVCache'", "3"], out.stdout
    assert os.path.exists(path)


def test_small_write_and_query_blocks_change_nothing():
    """max_rows (rows per commit) and q_block (query rows per attention call) only bound transients."""
    model = tiny_model("llama")
    tokens = mx.random.randint(0, 97, (1, 23))
    a = model(tokens, cache=make_prompt_cache(model, "tq4"))
    b = model(tokens, cache=make_prompt_cache(model, "tq4", max_rows=3, q_block=4))
    unpatch_model(model)
    assert mx.allclose(a, b, atol=1e-4).item()


def test_kv_bits_leaves_turbospark_caches_alone():
    model = tiny_model("llama")
    cache = make_prompt_cache(model, "tq4")
    greedy(model, mx.random.randint(0, 97, (9,)), cache, 3, kv_bits=4, quantized_kv_start=0)
    unpatch_model(model)
    assert all(type(c) is TurboSparkKVCache for c in cache)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_batch_generate_with_sliding_layers(family):
    model = tiny_model(family)
    tok = TinyTokenizer(97).wrapper
    patch_model(model, K8V8)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4, 5]]
    result = mlx_lm.batch_generate(model, tok, prompts, max_tokens=4)
    for p, text in zip(prompts, result.texts):
        assert text == tok.decode(greedy(model, mx.array(p), make_prompt_cache(model, K8V8), 4))
    unpatch_model(model)


def test_set_layer_arrays_checks_before_changing():
    from turbospark_mlx import KVCacheManager, LayerSpec, store_kv

    kv = KVCacheManager([LayerSpec(2, 32)], plain("tq4"))
    k = mx.random.normal((1, 2, 5, 32)).astype(mx.float16)
    store_kv(kv, 0, 0, k, k)
    before = {n: mx.array(a) for n, a in kv.layer_arrays(0).items()}
    bad = dict(before, k_norms=before["k_norms"].astype(mx.float16))
    with pytest.raises(ValueError, match="k_norms"):
        kv.set_layer_arrays(0, bad, 5)
    with pytest.raises(ValueError, match="offset"):
        kv.set_layer_arrays(0, before, 10**6)
    with pytest.raises(ValueError, match="stores"):
        kv.set_layer_arrays(0, {"keys": before["k_norms"]}, 1)
    assert kv.layer_offset(0) == 5
    assert all(mx.array_equal(kv.layer_arrays(0)[n], a).item() for n, a in before.items())
    kv.set_layer_arrays(0, before, 3)
    assert kv.layer_offset(0) == 3


def test_prompt_cache_file_digest_and_fresh_process(tmp_path):
    """save_prompt_cache writes mlx-lm's format plus a digest, atomically; load_prompt_cache
    refuses any changed byte or a truncation by name; stock mlx_lm.load_prompt_cache reads the
    file in a fresh process once the classes are registered."""
    import subprocess
    import sys

    from turbospark_mlx.mlx_lm import TurboSparkKVCache, load_prompt_cache, save_prompt_cache

    cache = TurboSparkKVCache("tq4", max_rows=64)
    q, k, v = (mx.random.normal((1, n, 150, 64)) for n in (4, 2, 2))
    cache.attend(q[:, :, :64], k[:, :, :64], v[:, :, :64], scale=0.125)
    cache.attend(q[:, :, 64:], k[:, :, 64:], v[:, :, 64:], scale=0.125)
    path = tmp_path / "p.safetensors"
    save_prompt_cache(str(path), [cache], {"note": "x"})
    (loaded,), meta = load_prompt_cache(str(path), return_metadata=True)
    assert loaded.offset == 150 and meta == {"note": "x"}
    qq = mx.random.normal((1, 4, 1, 64))
    kk, vv = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64))
    assert mx.array_equal(loaded.attend(qq, kk, vv, scale=0.125), cache.attend(qq, kk, vv, scale=0.125)).item()

    data = path.read_bytes()
    for i, at in enumerate((len(data) // 2, len(data) - 3, 200)):
        bad = tmp_path / f"bad{i}.safetensors"
        bad.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
        with pytest.raises(ValueError, match=bad.name):
            load_prompt_cache(str(bad))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="cut.safetensors"):
        load_prompt_cache(str(cut))

    probe = (
        "import sys; from mlx_lm.models.cache import load_prompt_cache\n"
        "import turbospark_mlx.mlx_lm as t; t.register_cache_classes()\n"
        "print(load_prompt_cache(sys.argv[1])[0].offset)"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "150", out.stderr[-2000:]


def test_round_trip_keeps_the_rings_trim_bound(tmp_path, monkeypatch):
    """A state saved after a trim carries the oldest position the FP16 ring still holds, so
    the loaded cache refuses the same second trim the saved one refuses (the trimmed rows'
    slots were written again); a state saved without it loads with a fresh ring's bound."""
    from turbospark_mlx.mlx_lm import cache as drop_in
    from turbospark_mlx.mlx_lm import save_prompt_cache

    config = get_preset("tq4").with_(name="p", window_rows=16, sink_rows=4, commit_rows=4)
    cache = TurboSparkKVCache(config, max_rows=64)  # 19 uncommitted rows: a ring of 83
    q, k, v = (mx.random.normal((1, n, 192, 64)) for n in (4, 2, 2))
    for a in range(0, 192, 64):
        cache.attend(q[:, :, a : a + 64], k[:, :, a : a + 64], v[:, :, a : a + 64], scale=0.125)
    assert cache.trim(30) == 30 and cache._kv.ring_from(0) == 109  # the ring holds 109..191
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert loaded._kv.ring_from(0) == 109
    for c in (cache, loaded):
        with pytest.raises(ValueError, match="no longer holds positions"):
            c.trim(35)  # 127 - 19 < 109
        assert c.offset == 162 and c.trim(34) == 34
    assert TurboSparkKVCache.from_state(cache.state[:-1])._kv.ring_from(0) == 0
    monkeypatch.setattr(drop_in, "_legacy_protocol", lambda: True)  # mlx-lm 0.31's arrays + strings
    legacy = TurboSparkKVCache.from_state(cache.state, cache.meta_state)
    assert legacy.offset == 128 and legacy._kv.ring_from(0) == cache._kv.ring_from(0) == 109
    monkeypatch.undo()
    with pytest.raises(ValueError, match="ring_from"):
        TurboSparkKVCache.from_state((*cache.state[:-1], cache.offset + 1))


BOUNDED = TurboQuantConfig("k8v4", 8, 4).with_(name="k8v4-w8", window_rows=8, sink_rows=4, center_keys=True)


def _own_twin(model):
    """The package's own llama with the tiny mlx-lm llama's weights (same arrays)."""
    from mlx.utils import tree_flatten

    from turbospark_mlx.models import llama as own_llama

    a = model.args
    own = own_llama.Model(own_llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        vocab_size=a.vocab_size, tie_word_embeddings=a.tie_word_embeddings, rope_theta=a.rope_theta,
    ))  # fmt: skip
    own.load_weights(tree_flatten(model.parameters()), strict=True)
    return own


def test_bounded_drop_in_matches_own_bounded_cache_with_flat_memory():
    """make_prompt_cache(..., max_kv_size=N): past N positions (the codes ring wraps) the drop-in
    follows the own model's bounded cache (8-bit codes: the two differ by their rotations, which
    the drop-in draws as for layer 0 in every layer) and not an unbounded cache, and its bytes
    stop growing; the layers it keeps FP16 are mlx-lm's
    RotatingKVCache(N, keep=4)."""
    from turbospark_mlx import make_cache

    model = tiny_model("llama")
    own = _own_twin(model)
    config = K8V8.with_(name="p", window_rows=8, sink_rows=4, center_keys=True, fp16_last=1)
    cache = make_prompt_cache(model, config, max_kv_size=40, max_rows=16, q_block=16)
    free = make_prompt_cache(model, config, max_rows=16, q_block=16)
    assert [type(c).__name__ for c in cache] == ["TurboSparkKVCache", "TurboSparkKVCache", "RotatingKVCache"]
    assert cache[2].max_size == 40 and cache[2].keep == 4
    ref = make_cache(own, config, max_kv_size=40, max_rows=16)
    tokens = mx.random.randint(0, 97, (1, 130))
    sizes, bounded, unbounded = [], [], []
    # Chunks only below the bound: past it mlx-lm's RotatingKVCache lets a chunk's rows see more
    # than max_size positions, the own FP16 ring does not.
    for s, e in [(0, 16), (16, 32)] + [(p, p + 1) for p in range(32, 130)]:
        want = own(tokens[:, s:e], cache=ref)
        bounded.append(rel_l2(model(tokens[:, s:e], cache=cache), want))
        unbounded.append(rel_l2(model(tokens[:, s:e], cache=free), want))
        if e >= 100:
            sizes.append(sum(c.nbytes for c in cache[:2]))
    assert max(bounded) < 1e-2, bounded
    assert min(unbounded[-20:]) > 10 * max(bounded), unbounded[-20:]
    assert len(set(sizes)) == 1, sizes
    unpatch_model(model)


def test_bounded_drop_in_round_trip_and_batch(tmp_path):
    """A bounded drop-in cache whose rings have wrapped saves and loads (mlx-lm's format) and
    continues identically; merged into a batch it keeps its bound."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 97, (90,))
    cache = make_prompt_cache(model, BOUNDED, max_kv_size=32, max_rows=16, q_block=16)
    for s in range(0, 89, 16):
        model(prompt[None, s : min(s + 16, 89)], cache=cache)
    path = str(tmp_path / "bounded.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(a.max_kv_size == b.max_kv_size == 32 and a.offset == b.offset == 89 for a, b in zip(cache, loaded))
    want = greedy(model, prompt[-1:], copy.deepcopy(cache), 6)
    assert greedy(model, prompt[-1:], loaded, 6) == want
    batch = TurboSparkKVCache.merge([cache[0], copy.deepcopy(cache[0])])
    assert all(s.max_kv_size == 32 for s in batch.seqs)
    unpatch_model(model)


def test_bounded_drop_in_refuses_bounds_it_cannot_keep():
    """A bound the FP16 window and sink rows fill, or a preset without them, is refused with the
    reason before the model is converted."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="leaves nothing to compress"):
        make_prompt_cache(model, BOUNDED, max_kv_size=12)
    with pytest.raises(ValueError, match="needs a protected preset"):
        make_prompt_cache(model, plain("tq4"), max_kv_size=64)
    with pytest.raises(ValueError, match="int >= 1"):
        make_prompt_cache(model, BOUNDED, max_kv_size=0)
    assert not any(hasattr(type(layer.self_attn), "_turbospark_original") for layer in model.layers)
