"""gemma3, gemma4, gpt-oss and muse_glimmer on the TurboQuant cache.

Parity with mlx-lm's implementation of each family (same random weights),
cached decode, chunked prefill, the per-layer cache layout (rings for sliding
layers, TurboQuant for global ones, no storage for gemma4's shared layers),
MXFP4 and GGUF loading, long generation and bad input.
"""

import json

import mlx.core as mx

import pytest
from conftest import plain
from families import CONFIGS, FAMILIES, LONG_CONFIGS, greedy, modules, pair
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from turbospark_mlx import make_cache
from turbospark_mlx.quant.config import PRESETS, TurboQuantConfig

# Our K/V live in float16 (mlx-lm's stay in the float32 of these tiny models):
# measured max |logit diff| is 2.0e-3 (gemma3), 1.4e-3 (gemma4), 8.6e-5 (gpt-oss),
# 2.4e-4 (muse_glimmer) on logits of magnitude 0.3-3. With float16 weights on
# both sides gemma3 and muse_glimmer match exactly.
PARITY_ATOL = 5e-3
L = 24  # tokens: three windows of 8, so rings wrap


def _tokens(n=L, seed=1):
    return mx.random.randint(0, 128, (1, n), key=mx.random.key(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_and_cached_decode_match_mlx_lm(family):
    ref, model = pair(family)
    x = _tokens()
    assert mx.allclose(model(x), ref(x), atol=PARITY_ATOL, rtol=0).item()
    ref_cache, cache = make_prompt_cache(ref), make_cache(model, "fp16")
    for t in range(L):
        want = ref(x[:, t : t + 1], cache=ref_cache)
        got = model(x[:, t : t + 1], cache=cache)
        assert mx.allclose(got, want, atol=PARITY_ATOL, rtol=0).item(), (family, t)
    assert cache.offset == L


@pytest.mark.parametrize("family", ["gemma3_text", "muse_glimmer"])
def test_float16_weights_match_mlx_lm_exactly(family):
    # With float16 weights both sides keep K/V in float16: any gap is a real difference.
    ref, model = pair(family)
    ref.set_dtype(mx.float16)
    model.set_dtype(mx.float16)
    x = _tokens()
    assert mx.array_equal(model(x), ref(x)).item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv", ["tq4", "k8v3"])
def test_chunked_prefill_equals_token_steps_turboquant(family, kv):
    _, model = pair(family)
    x = _tokens()
    chunked, steps = make_cache(model, kv, max_rows=8), make_cache(model, kv, max_rows=8)
    a = mx.concatenate([model(x[:, i : i + 5], cache=chunked) for i in range(0, L, 5)], axis=1)
    b = mx.concatenate([model(x[:, i : i + 1], cache=steps) for i in range(L)], axis=1)
    # A step (one row: its sink and window rows sliced) and a chunk (a masked tile) are two
    # attention paths: equal up to float32 rounding carried through the layers.
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), mx.abs(a - b).max().item()
    assert chunked.offset == steps.offset == L


def _layer_kinds(model):
    """Per layer: 'shared', 'sliding' or 'global', from the model's own specs."""
    return [
        "shared" if s.shared_from is not None else ("sliding" if s.window is not None else "global")
        for s in model.kv_layer_specs()
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tq4_compresses_global_layers_and_bounds_rings(family):
    _, model = pair(family)
    max_rows, n = 4, 40  # 40 positions: five windows of 8
    cache = make_cache(model, plain("tq4"), max_rows=max_rows, step=16)  # codes only: the bytes formula
    x = _tokens(n)
    for i in range(0, n, max_rows):
        model(x[:, i : i + max_rows], cache=cache)
    summary = cache.summary()
    print(summary)
    kinds = _layer_kinds(model)
    assert "global" in kinds and "sliding" in kinds
    lines = summary.splitlines()[2:-1]
    total = 0
    for i, (kind, spec, line) in enumerate(zip(kinds, cache.specs, lines)):
        fp16_row = 2 * spec.n_kv_heads * spec.head_dim  # FP16 bytes of one K or V row
        row = cache.dtype.size * spec.n_kv_heads * spec.head_dim  # as stored (the model's dtype)
        if kind == "shared":
            assert f"shared -> {spec.shared_from}" in line and line.rstrip().endswith(" 0")
            assert cache.layer_quant(i) is cache.layer_quant(spec.shared_from)
            continue
        nbytes = cache.layer_nbytes(i)
        total += nbytes
        if kind == "global":
            assert "turboquant k4v4" in line and cache.layer_quant(i) is not None
            per_token = PRESETS["tq4"].bytes_per_token(spec.head_dim) * spec.n_kv_heads
            assert nbytes == per_token * 48  # 40 positions in steps of 16
            assert nbytes < 2 * fp16_row * 48 / 3  # well under FP16's bytes
        else:
            assert "fp16 ring" in line and cache.layer_quant(i) is None
            cap = spec.window + max_rows - 1
            assert cache.ring_capacity(i) == cap and nbytes == 2 * row * cap  # window-bounded, not 40
    assert cache.nbytes == total


def test_gemma4_shared_layers_own_no_storage_and_k_eq_v_has_no_v_proj():
    _, model = pair("gemma4_text")
    specs = model.kv_layer_specs()
    # 6 layers [s, s, g, s, s, g], the last two KV-shared: 4 -> 3 (sliding), 5 -> 2 (global).
    assert [s.shared_from for s in specs] == [None, None, None, None, 3, 2]
    assert (specs[2].n_kv_heads, specs[2].head_dim) == (1, 64) and (
        specs[0].n_kv_heads,
        specs[0].head_dim,
    ) == (2, 32)
    cache = make_cache(model, "tq4")
    model(_tokens(), cache=cache)
    assert set(cache.owned_layers()) == {0, 1, 2, 3}  # shared layers have no storage entry at all
    assert sum(cache.layer_nbytes(i) for i in range(4)) == cache.nbytes
    assert "v_proj" not in model.layers[2].self_attn and "v_proj" in model.layers[0].self_attn
    assert "k_proj" not in model.layers[4].self_attn


def test_gpt_oss_sinks_reach_turboquant_attention():
    ref, model = pair("gpt_oss")
    x = _tokens()
    fp16 = model(x, cache=make_cache(model, "fp16"))
    # 8-bit TurboQuant is close to lossless, so with sinks honoured it tracks FP16 ...
    tq8 = model(x, cache=make_cache(model, TurboQuantConfig("k8v8", 8, 8)))
    err = mx.abs(tq8 - fp16).max().item()
    # ... and the sinks move the logits far more than that error.
    for layer in model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    no_sinks = model(x, cache=make_cache(model, TurboQuantConfig("k8v8", 8, 8)))
    effect = mx.abs(no_sinks - tq8).max().item()
    assert err < 0.02 and effect > 10 * err, (err, effect)


def _mxfp4_checkpoint(params: dict, config: dict) -> dict:
    """OpenAI's MXFP4 layout: experts' fused gate_up (interleaved rows) as *_blocks/*_scales."""
    out = {}
    for k, v in params.items():
        if ".mlp.experts." not in k:
            out[k] = v
            continue
        base, proj, kind = k.rsplit(".", 2)
        if proj == "up_proj":
            continue
        if proj == "gate_proj":
            up = params[f"{base}.up_proj.{kind}"]
            v = mx.stack([v, up], axis=-2 if kind == "weight" else -1)  # interleave rows
            v = (
                v.reshape(*v.shape[:-3], -1, v.shape[-1])
                if kind == "weight"
                else v.reshape(*v.shape[:-2], -1)
            )
            proj = "gate_up_proj"
        if kind == "bias":
            out[f"{base}.{proj}_bias"] = v
        else:
            w, scales = mx.quantize(v, group_size=32, bits=4, mode="mxfp4")
            out[f"{base}.{proj}_blocks"] = w.view(mx.uint8).reshape(*w.shape[:-1], -1, 16)
            out[f"{base}.{proj}_scales"] = scales
    return out


def test_gpt_oss_mxfp4_checkpoint_loads_and_matches_mlx_lm(tmp_path):
    from mlx_lm.utils import load_model

    mine, ref_mod = modules("gpt_oss")
    config = {**CONFIGS["gpt_oss"], "quantization_config": {"quant_method": "mxfp4"}}
    ref, _ = pair("gpt_oss")
    params = dict(tree_flatten(ref.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), _mxfp4_checkpoint(params, config))
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref_q, _ = load_model(tmp_path, get_model_classes=lambda config: (ref_mod.Model, ref_mod.ModelArgs))
    model, _ = load_model(tmp_path, get_model_classes=lambda config: (mine.Model, mine.ModelArgs))
    experts = model.layers[0].mlp.experts
    assert experts.gate_proj.mode == "mxfp4" and experts.gate_proj.weight.dtype == mx.uint32
    x = _tokens()
    assert mx.allclose(model(x), ref_q(x), atol=PARITY_ATOL, rtol=0).item()
    # mlx-community's layout: already split and renamed, "quantization" in the config.
    community = tmp_path / "community"
    community.mkdir()
    mx.save_safetensors(str(community / "model.safetensors"), dict(tree_flatten(ref_q.parameters())))
    (community / "config.json").write_text(
        json.dumps({**CONFIGS["gpt_oss"], "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}})
    )
    reloaded, _ = load_model(community, get_model_classes=lambda config: (mine.Model, mine.ModelArgs))
    assert reloaded.layers[1].mlp.experts.down_proj.mode == "mxfp4"
    assert mx.array_equal(reloaded(x), model(x)).item()
    # The MXFP4 model on tq4 decodes like its own chunked prefill.
    a = model(x, cache=make_cache(model, "tq4"))
    c = make_cache(model, "tq4")
    b = mx.concatenate([model(x[:, i : i + 1], cache=c) for i in range(L)], axis=1)
    assert mx.allclose(a, b, atol=1e-5, rtol=0).item()


def test_gemma3_loads_from_gguf(tmp_path):
    """A gemma3 GGUF written the way convert_hf_to_gguf.py does loads through turbospark_mlx.loading."""
    from turbospark_mlx.loading import GGUF_ARCHITECTURES, load_gguf_model

    tensor_map = GGUF_ARCHITECTURES["gemma3"].tensors
    config = {**CONFIGS["gemma3_text"], "sliding_window_pattern": 6, "num_hidden_layers": 6}
    ref, model = pair("gemma3_text", config)
    params = dict(tree_flatten(model.parameters()))
    back = {v: k for k, v in tensor_map.items() if "{i}" not in k}  # non-layer names
    gguf = {}
    for name, value in params.items():
        base, suffix = name.rsplit(".", 1)
        parts = base.split(".")
        if parts[:2] == ["model", "layers"]:
            key = "model.layers.{i}." + ".".join(parts[3:])
            gname = next(g for g, h in tensor_map.items() if h == key).format(i=parts[2])
        else:
            gname = back[base]
        if name.endswith("norm.weight"):
            value = value + 1.0  # what convert_hf_to_gguf.py stores
        gguf[f"{gname}.{suffix}"] = value
    assert {n for n in gguf if n.startswith("blk.0.")} == {
        f"blk.0.{t}.weight"
        for t in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_q_norm",
            "attn_k_norm",
            "post_attention_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "post_ffw_norm",
        )
    }
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": mx.array(64),
        "gemma3.block_count": mx.array(6),
        "gemma3.feed_forward_length": mx.array(128),
        "gemma3.attention.head_count": mx.array(4),
        "gemma3.attention.head_count_kv": mx.array(2),
        "gemma3.attention.key_length": mx.array(32),
        "gemma3.attention.layer_norm_rms_epsilon": mx.array(1e-6),
        "gemma3.attention.sliding_window": mx.array(8),
        "gemma3.rope.freq_base": mx.array(1e6),
    }
    path = tmp_path / "tiny-gemma3.gguf"
    mx.save_gguf(str(path), gguf, meta)
    loaded, _ = load_gguf_model(path, dtype=mx.float32)
    assert type(loaded).__module__ == "turbospark_mlx.models.gemma3_text"
    assert not loaded.tie_word_embeddings and loaded.args.query_pre_attn_scalar == 32
    x = _tokens()
    assert mx.allclose(loaded(x), ref(x), atol=PARITY_ATOL, rtol=0).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_preset_compressing_a_sliding_layer_is_an_error(family):
    _, model = pair(family)
    sliding = _layer_kinds(model).index("sliding")
    bad = TurboQuantConfig("bad", 4, 4, quantize_layers=(sliding,))
    with pytest.raises(ValueError, match="sliding-window"):
        make_cache(model, bad)


@pytest.mark.parametrize("policy", [{"quantize_layers": (2, 5)}, {"fp16_layers": (5,)}])
def test_preset_naming_a_gemma4_shared_layer_is_an_error(policy):
    # Layer 5 reads layer 2's KV: naming it would silently do nothing.
    _, model = pair("gemma4_text")
    with pytest.raises(
        ValueError, match="names layer 5, which reads layer 2's KV .* name the owner, layer 2"
    ):
        make_cache(model, TurboQuantConfig("bad", 4, 4, **policy))
    assert make_cache(model, TurboQuantConfig("ok", 4, 4, quantize_layers=(2,))).layer_quant(5) is not None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "sliding_window"])
def test_missing_config_field_is_named(family, field):
    mine, _ = modules(family)
    config = {k: v for k, v in CONFIGS[family].items() if k != field}
    with pytest.raises(ValueError, match=f"lacks required field.*{field}"):
        mine.ModelArgs.from_dict(config)


def test_inconsistent_configs_are_refused():
    g4, _ = modules("gemma4_text")
    with pytest.raises(ValueError, match="KV-shared layer 1 .* no earlier layer"):
        g4.ModelArgs.from_dict(
            {
                **CONFIGS["gemma4_text"],
                "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
                "num_kv_shared_layers": 1,
            }
        )
    with pytest.raises(ValueError, match="layer_types must list 6"):
        g4.ModelArgs.from_dict({**CONFIGS["gemma4_text"], "layer_types": ["full_attention"]})
    oss, _ = modules("gpt_oss")
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        oss.ModelArgs.from_dict({**CONFIGS["gpt_oss"], "num_experts_per_tok": 5})


def test_gpt_oss_sink_of_wrong_shape_is_refused():
    mine, _ = modules("gpt_oss")
    _, model = pair("gpt_oss")
    weights = dict(tree_flatten(model.parameters()))
    weights["model.layers.1.self_attn.sinks"] = mx.zeros((5,))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.sinks has shape \(5,\), expected \(4,\)"):
        model.sanitize(weights)
    # Set on a live model: refused before anything is written, the cache keeps its state.
    cache = make_cache(model, "tq4")
    model(_tokens(4), cache=cache)
    model.layers[1].self_attn.sinks = mx.zeros((2, 2))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\), got \(2, 2\)"):
        model(_tokens(1), cache=cache)
    assert [cache.layer_offset(i) for i in range(4)][1:] == [4, 4, 4]
    assert not cache.stage.pending


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_2k_past_window_tq4_bounded_memory(family):
    _, model = pair(family, LONG_CONFIGS[family])
    window, steps, max_rows = 16, 16 + 2048, 8
    prompt = _tokens(8)
    # The same run on a throwaway cache first: on the CPU the first run in a process peaks ~2 MiB
    # higher on the gemma families (one-time allocations), which is not a step's working set.
    greedy(model, prompt, steps, make_cache(model, "tq4", max_rows=max_rows, step=256))
    cache = make_cache(model, "tq4", max_rows=max_rows, step=256)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tokens = greedy(model, prompt, steps, cache)
    peak = mx.get_peak_memory() - base
    assert tokens.shape == (steps,) and cache.offset == 8 + steps - 1
    kinds = _layer_kinds(model)
    assert "global" in kinds and "sliding" in kinds
    largest = 0  # float32 K+V of the largest owned layer's history
    for i, (kind, spec) in enumerate(zip(kinds, cache.specs)):
        if kind == "sliding":  # still exactly window + max_rows - 1 rows after 2k tokens
            row = 2 * cache.dtype.size * spec.n_kv_heads * spec.head_dim  # K and V, the model's dtype
            assert cache.layer_nbytes(i) == row * (window + max_rows - 1)
        elif kind == "global":
            assert cache.layer_quant(i) is not None
            largest = max(largest, 8 * spec.n_kv_heads * spec.head_dim * cache.layer_offset(i))
    print(
        f"{family}: peak above start {peak / 2**20:.2f} MiB, cache {cache.nbytes / 2**20:.3f} MiB, "
        f"staging {cache.stage.nbytes / 2**20:.3f} MiB, one layer's float32 K+V {largest / 2**20:.2f} MiB"
    )
    # Peak growth = the cache plus one step's working set: the reference TurboQuant
    # attention dequantizes one layer's history to float32 (with index temporaries)
    # at a time; nothing scales with the number of layers or keeps an FP16 shadow.
    assert peak < cache.nbytes + cache.stage.nbytes + 3 * largest + 2**18


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_multimodal_wrappers_drop_towers_and_match_mlx_lm(family):
    import importlib

    text = f"{family}_text"
    mine = importlib.import_module(f"turbospark_mlx.models.{family}")
    ref_mod = importlib.import_module(f"mlx_lm.models.{family}")
    config = {"model_type": family, "vocab_size": 128, "text_config": dict(CONFIGS[text])}
    ref = ref_mod.Model(ref_mod.ModelArgs.from_dict(json.loads(json.dumps(config))))
    model = mine.Model(mine.ModelArgs.from_dict(json.loads(json.dumps(config))))
    _, donor = pair(text)  # random text weights, renamed the way the checkpoints nest them
    prefix = "language_model." if family == "gemma3" else "model.language_model."
    weights = {}
    for k, v in tree_flatten(donor.parameters()):
        k = k.removeprefix("model.") if family == "gemma4" else k
        weights[prefix + k] = v
    weights["vision_tower.patch.weight"] = mx.zeros((2, 2))
    ref.load_weights(list(ref.sanitize(dict(weights)).items()))
    model.load_weights(list(model.sanitize(dict(weights)).items()))
    x = _tokens()
    assert mx.allclose(model(x), ref(x), atol=PARITY_ATOL, rtol=0).item()
    assert [s.window for s in model.kv_layer_specs()] == [s.window for s in donor.kv_layer_specs()]
    with pytest.raises(ValueError, match="lacks required field.*text_config"):
        mine.ModelArgs.from_dict({"model_type": family})
