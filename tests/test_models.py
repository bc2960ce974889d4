"""Each family vs mlx-lm's implementation of it: same tiny random config, same weights.

Full forward and token-by-token cached decode on an FP16 cache; plus chunked
prefill vs one-token steps on a TurboQuant cache, and the registry's errors.
"""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import turbospark_mlx as ts
from turbospark_mlx.models import MODEL_REMAPPING, get_model_classes, supported_model_types

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": dict(
        BASE,
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": dict(BASE, model_type="mistral", rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=32, rope_theta=1000000.0),
}
MLX_LM_NAME = {"mistral": "llama"}


def model_pair(name: str):
    """Our model and mlx-lm's, built from one config and holding the same random float32 weights."""
    config = CONFIGS[name]
    ref_mod = importlib.import_module(f"mlx_lm.models.{MLX_LM_NAME.get(name, name)}")
    ref = ref_mod.Model(ref_mod.ModelArgs.from_dict(config))
    Model, Args = get_model_classes(config["model_type"])
    ours = Model(Args.from_dict(config))
    # Widen the random init so the layers do real work (the default init is near-identity).
    ref.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2, ref.parameters()))
    ours.load_weights(tree_flatten(ref.parameters()), strict=True)
    mx.eval(ref.parameters(), ours.parameters())
    return ours, ref


def tokens(n: int, vocab: int = 128, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(1, n)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_mlx_lm(name):
    ours, ref = model_pair(name)
    x = tokens(40)
    want = ref(x)
    got = ours(x)
    assert got.shape == want.shape == (1, 40, 128)
    # Both caches keep the float32 model's K/V in float32: only the order of float32 sums
    # differs; a wrong layer is off by O(1).
    err = mx.abs(got - want).max().item()
    assert err < 1e-4 * max(1.0, mx.abs(want).max().item()), err


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_matches_mlx_lm(name):
    """Prefill 9 tokens, then decode 1 token at a time with the FP16 cache; mlx-lm does the same with its KVCache."""
    ours, ref = model_pair(name)
    x = tokens(24, seed=2)
    cache = ts.make_cache(ours, kv="fp16", max_rows=16)
    ref_cache = ref.make_cache() if hasattr(ref, "make_cache") else None
    if ref_cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        ref_cache = make_prompt_cache(ref)
    got = [ours(x[:, :9], cache=cache)]
    want = [ref(x[:, :9], cache=ref_cache)]
    for t in range(9, 24):
        got.append(ours(x[:, t : t + 1], cache=cache))
        want.append(ref(x[:, t : t + 1], cache=ref_cache))
    got, want = mx.concatenate(got, axis=1), mx.concatenate(want, axis=1)
    assert cache.offset == 24
    # Both caches keep float32 K/V (the model's dtype): float32 summation order only.
    err = mx.abs(got - want).max().item()
    assert err < 1e-4 * max(1.0, mx.abs(want).max().item()), err
    # and decoding against the cache equals the full forward pass of our own model.
    full = ours(x)
    assert mx.abs(got - full).max().item() < 1e-4 * max(1.0, mx.abs(full).max().item())


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bounded_cache_matches_mlx_lm_rotating_cache(name):
    """max_kv_size=12 on the FP16 cache against mlx-lm's cache for --max-kv-size 12
    (RotatingKVCache(12, keep=4) per layer), one token at a time past three rotations; and a
    bounded tq4 cache prefilled in chunks equals its own one-token steps."""
    from mlx_lm.models.cache import RotatingKVCache

    ours, ref = model_pair(name)
    x = tokens(40, seed=4)
    cache = ts.make_cache(ours, kv="fp16", max_rows=8, max_kv_size=12)
    ref_cache = [RotatingKVCache(max_size=12, keep=4) for _ in ref.layers]
    got = mx.concatenate([ours(x[:, t : t + 1], cache=cache) for t in range(40)], axis=1)
    want = mx.concatenate([ref(x[:, t : t + 1], cache=ref_cache) for t in range(40)], axis=1)
    err = mx.abs(got - want).max().item()
    assert err < 2e-3 * max(1.0, mx.abs(want).max().item()), err
    assert mx.abs(got - ours(x)).max().item() > 1e-2  # the bound changes what is attended to
    n, kv = 200, ts.get_preset("tq4").with_(window_rows=16)
    y = tokens(n, seed=5)

    def run(chunk: int) -> mx.array:
        cache = ts.make_cache(ours, kv=kv, max_rows=16, max_kv_size=48)
        return mx.concatenate([ours(y[:, s : s + chunk], cache=cache) for s in range(0, n, chunk)], axis=1)

    steps, chunks = run(1), run(16)
    assert mx.abs(chunks - steps).max().item() < 1e-4 * max(1.0, mx.abs(steps).max().item())


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("kv", ["tq4", "k4v3"])
def test_chunked_prefill_matches_token_steps_on_turboquant_cache(name, kv):
    """Chunks of 1, 7 and 512 rows give the logits of one-token steps (a TurboQuant layer reads its new rows back from codes)."""
    ours, _ = model_pair(name)
    n = 530
    x = tokens(n, seed=3)

    def run(chunk: int) -> mx.array:
        cache = ts.make_cache(ours, kv=kv, max_rows=max(chunk, 1))
        outs = []
        for s in range(0, n, chunk):
            outs.append(ours(x[:, s : s + chunk], cache=cache))
            mx.eval(outs[-1])
        return mx.concatenate(outs, axis=1)

    steps = run(1)
    scale = mx.abs(steps).max().item()
    for chunk in (7, 512):
        err = mx.abs(run(chunk) - steps).max().item()
        # Same codes either way; only float32 summation order differs.
        assert err < 1e-4 * max(1.0, scale), (chunk, err)


def test_registry_lists_files_and_aliases():
    types = supported_model_types()
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(types)
    assert "base" not in types
    for alias, target in MODEL_REMAPPING.items():
        assert get_model_classes(alias) == get_model_classes(target)


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError) as e:
        get_model_classes("bert")
    msg = str(e.value)
    assert "'bert'" in msg and "llama" in msg and "qwen3" in msg


def test_biased_keys_break_plain_4bit_not_the_shipped_tq4():
    """A tiny qwen2 whose key projections carry a large bias on the low-frequency RoPE channels
    (where biased-key model families keep theirs): plain 4-bit TurboQuant keys lose the attention
    pattern, the shipped tq4 (FP16 window, sink rows, centred keys) keeps the model's predictions."""
    config = dict(CONFIGS["qwen2"], hidden_size=128, intermediate_size=256, max_position_embeddings=1024)
    Model, Args = get_model_classes("qwen2")
    model = Model(Args.from_dict(config))
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    D = config["hidden_size"] // config["num_attention_heads"]
    for layer in model.model.layers:
        b = layer.self_attn.k_proj.bias
        low = mx.array([float((c % D) % (D // 2) >= D // 4) for c in range(b.shape[0])])
        layer.self_attn.k_proj.bias = b + 300.0 * low * mx.random.normal(b.shape)
    mx.eval(model.parameters())
    L, chunk = 400, 64
    x = mx.random.randint(0, config["vocab_size"], (1, L))

    def logprobs(kv):
        cache = ts.make_cache(model, kv=kv, max_rows=chunk)
        out = mx.concatenate([model(x[:, s : s + chunk], cache=cache) for s in range(0, L, chunk)], axis=1)
        return nn.log_softmax(out[0, 200:].astype(mx.float32))  # positions well past the window

    ref = logprobs("fp16")

    def agreement_and_kl(kv):
        lp = logprobs(kv)
        agree = (lp.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
        return agree, (mx.exp(ref) * (ref - lp)).sum(-1).mean().item()

    agree, kl = agreement_and_kl(ts.get_preset("tq4").plain())
    assert agree < 0.8 and kl > 0.02, (agree, kl)  # broken
    agree, kl = agreement_and_kl("tq4")
    assert agree >= 0.98 and kl < 0.002, (agree, kl)


def test_cache_stores_the_models_dtype():
    """A cache keeps its uncompressed rows and staging in the model's dtype (float32, bfloat16;
    float16 for a float16 model), so attention never casts the history: also a protected
    layer's ring and an uncached forward pass's cache."""
    ours, _ = model_pair("llama")
    cache = ts.make_cache(ours, "k8v4")
    assert cache.dtype == mx.float32
    ours(tokens(5), cache=cache)
    assert cache.layer_arrays(0)["k_recent"].dtype == mx.float32
    ours.set_dtype(mx.float16)
    assert ts.make_cache(ours, "fp16").dtype == mx.float16
    ours.set_dtype(mx.bfloat16)
    nn.quantize(ours, group_size=32, bits=4)
    cache = ts.make_cache(ours, "fp16")
    assert cache.dtype == mx.bfloat16
    ours(tokens(5), cache=cache)
    assert cache.layer_arrays(0)["keys"].dtype == mx.bfloat16
