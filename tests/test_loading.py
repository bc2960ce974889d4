"""Loading: HF directories (plain, sharded, MLX-quantized), HF repo ids from the local cache,
GGUF files built here from known weights (llama with llama.cpp's Q/K row order, qwen3),
and clear errors on bad input."""

import json


import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, models, pre_tokenizers

import turbospark_mlx as ts
from turbospark_mlx.loading import gguf as gguf_loading
from turbospark_mlx.loading.gguf import GGUF_ARCHITECTURES, affine_from_gguf, load_gguf_model, unpermute_rows
from turbospark_mlx.models import get_model_classes

VOCAB = 64
CONFIG = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
)
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]


def random_model(config=CONFIG, seed=0):
    mx.random.seed(seed)
    Model, Args = get_model_classes(config["model_type"])
    model = Model(Args.from_dict(config))
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    mx.eval(model.parameters())
    return model


def varied_model(config=CONFIG):
    """A tiny model whose greedy output rarely repeats a token (weights at std 0.8), so a
    wrong position or a mixed-up cache shows in the text."""
    mx.random.seed(1)
    Model, Args = get_model_classes(config["model_type"])
    model = Model(Args.from_dict(config))
    model.update(nn.utils.tree_map(lambda p: 0.8 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def write_tokenizer(path):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )


def write_hf_dir(path, model, config=CONFIG, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(model.parameters()))
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights)
    else:
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            mx.save_safetensors(str(path / fname), part)
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_tokenizer(path)
    return path


def prompt_ids(n=12, seed=1):
    return mx.array(np.random.default_rng(seed).integers(3, VOCAB, size=(1, n)))


def test_hf_dir_round_trip(tmp_path):
    model = random_model()
    loaded, tok = ts.load(write_hf_dir(tmp_path / "m", model))
    x = prompt_ids()
    assert mx.array_equal(loaded(x), model(x)).item()
    assert tok.encode("w1 w2 w3", add_special_tokens=False) == [4, 5, 6]
    assert 2 in tok.eos_token_ids


def test_hf_dir_sharded_and_missing_shard(tmp_path):
    model = random_model()
    path = write_hf_dir(tmp_path / "m", model, shards=3)
    loaded, _ = ts.load(path)
    x = prompt_ids()
    assert mx.array_equal(loaded(x), model(x)).item()
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003"):
        ts.load(path)


def test_hf_dir_mlx_quantized(tmp_path):
    """Weights quantized as mlx-community publishes them: packed weights + config's quantization block."""
    model = random_model()
    nn.quantize(model, group_size=32, bits=4)
    config = dict(CONFIG, quantization={"group_size": 32, "bits": 4})
    path = write_hf_dir(tmp_path / "q", model, config)
    x = prompt_ids()
    want = model(x)
    # Kept packed: on the CPU the layers take the packed-weight kernels where they run here
    # (`cpu_ext`, tested in test_cpu_ext.py), MLX's quantized matmul elsewhere.
    loaded, _ = ts.load(path, dequantize=False)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert mx.abs(loaded(x) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    # Unpacked to float32: the same weights, so the same logits to float32 rounding.
    dense, _ = ts.load(path, dequantize=True)
    assert type(dense.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(dense.model.embed_tokens) is nn.Embedding
    assert mx.abs(dense(x) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    # The default on the CPU: packed where the kernels run, else unpacked.
    default, _ = ts.load(path)
    packed = ts.cpu_ext.available()
    assert isinstance(default.model.layers[0].self_attn.q_proj, nn.QuantizedLinear) is packed


def test_repo_id_from_offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    model = random_model()
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("a" * 40)
    write_hf_dir(snap, model)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    loaded, _ = ts.load("tiny-org/tiny-llama")
    x = prompt_ids()
    assert mx.array_equal(loaded(x), model(x)).item()
    with pytest.raises(FileNotFoundError, match="tiny-org/absent"):
        ts.load("tiny-org/absent")


# -- GGUF ------------------------------------------------------------------------------


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF half-split rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(config) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3 scaling as rope_freqs."""
    sc, d = config["rope_scaling"], config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    low_wl = sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    high_wl = sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    factors = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            factors.append(1.0)
        elif wl > low_wl:
            factors.append(sc["factor"])
        else:
            smooth = (sc["original_max_position_embeddings"] / wl - sc["low_freq_factor"]) / (
                sc["high_freq_factor"] - sc["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / sc["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, model, config, arch, qtype=None, metadata=None):
    """A GGUF holding `model`'s weights under llama.cpp names: F32, or `qtype` for 2-D weights,
    or what `qtype(name, array)` returns for each tensor: (bytes, type), or None for F32.
    `metadata(writer)` adds more keys."""
    if not callable(qtype):
        fixed = qtype

        def qtype(name, a):
            return (gguf.quants.quantize(a, fixed), fixed) if fixed is not None and a.ndim == 2 else None

    spec = GGUF_ARCHITECTURES[arch]
    reverse = {}
    for stem, hf in spec.tensors.items():
        for i in range(config["num_hidden_layers"]):
            reverse[hf.format(i=i)] = stem.format(i=i)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_vocab_size(config["vocab_size"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if metadata is not None:
        metadata(w)
    if "rope_scaling" in config:
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(config))
    for name, a in tree_flatten(model.parameters()):
        stem, part = name.rsplit(".", 1)
        a = np.array(a.astype(mx.float32))
        if spec.permute_qk and stem.endswith(("q_proj", "k_proj")):
            heads = (
                config["num_attention_heads"] if stem.endswith("q_proj") else config["num_key_value_heads"]
            )
            a = permute_like_llama_cpp(a, heads)
        raw = qtype(f"{reverse[stem]}.{part}", a)
        if raw is not None:
            w.add_tensor(f"{reverse[stem]}.{part}", raw[0], raw_dtype=raw[1])
        else:
            w.add_tensor(f"{reverse[stem]}.{part}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QWEN3 = dict(CONFIG, model_type="qwen3", head_dim=32, rope_theta=1000000.0)


LLAMA31 = dict(
    CONFIG,
    max_position_embeddings=256,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)


QWEN2 = dict(CONFIG, model_type="qwen2", rope_theta=1000000.0)  # Q/K/V biases: attn_q.bias, ...


@pytest.mark.parametrize(
    "arch,config", [("llama", CONFIG), ("llama", LLAMA31), ("qwen2", QWEN2), ("qwen3", QWEN3)]
)
def test_gguf_float_weights_map_back_exactly(tmp_path, arch, config):
    model = random_model(config)
    loaded, meta = load_gguf_model(write_gguf(tmp_path / "m.gguf", model, config, arch), dtype=mx.float32)
    assert meta["general.architecture"] == arch
    x = prompt_ids(60)  # past original_max_position_embeddings, where llama3 scaling matters
    err = mx.abs(loaded(x) - model(x)).max().item()
    assert err < 1e-5, err


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0])
def test_gguf_quantized_weights(tmp_path, qtype):
    """Both stay packed: mx.load reads Q8_0; the gguf package reads Q5_0, repacked to 8 bits.

    The oracle holds the weights the gguf package itself round-trips through `qtype`.
    """
    model = random_model()
    loaded, _ = load_gguf_model(
        write_gguf(tmp_path / "q.gguf", model, CONFIG, "llama", qtype), dtype=mx.float32
    )
    assert loaded.model.layers[0].self_attn.q_proj.bits == 8

    def round_trip(a):
        if a.ndim != 2:
            return a
        q = gguf.quants.quantize(np.array(a), qtype)
        return mx.array(gguf.quants.dequantize(q, qtype).reshape(a.shape))

    model.update(nn.utils.tree_map(round_trip, model.parameters()))
    x = prompt_ids()
    want = model(x)
    err = mx.abs(loaded(x) - want).max().item()
    assert err < 1e-3 * mx.abs(want).max().item(), err


def k_quant_blocks(rows: int, cols: int, qtype=gguf.GGMLQuantizationType.Q4_K, seed: int = 0) -> np.ndarray:
    """K-quant data of a (rows, cols) matrix (gguf cannot quantize to K-quants): random codes and
    sub-block scales, with the float16 super-block scales (Q4_K, Q5_K: d and dmin first; Q6_K: d
    last) of a weight's size."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in (size - 2,) if qtype == gguf.GGMLQuantizationType.Q6_K else (0, 2):
        blocks[:, at : at + 2] = rng.uniform(1e-3, 4e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
def test_affine_from_gguf_repacks_blocks_exactly(name):
    """Each repacked weight is the value llama.cpp's dequantization (the gguf package's) gives."""
    qtype = gguf.GGMLQuantizationType[name]
    if name.endswith("_K"):
        data = k_quant_blocks(24, 512, qtype)
    else:
        weights = np.random.default_rng(1).standard_normal((24, 512)).astype(np.float32)
        data = gguf.quants.quantize(weights, qtype)
    w, scales, biases = affine_from_gguf(data, qtype, (24, 512))
    bits = 4 if name.startswith("Q4") else 8
    assert w.dtype == np.uint32 and w.shape == (24, 512 * bits // 32) and scales.shape == (24, 16)
    got = mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=32, bits=bits)
    want = gguf.quants.dequantize(data, qtype).reshape(24, 512)
    assert np.array_equal(np.array(got), want)


def test_affine_from_gguf_leaves_other_types_and_shapes():
    q6 = k_quant_blocks(4, 256, gguf.GGMLQuantizationType.Q6_K)
    assert affine_from_gguf(q6, gguf.GGMLQuantizationType.Q6_K, (4, 256)) is None
    q8 = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert affine_from_gguf(q8, gguf.GGMLQuantizationType.Q8_0, (2, 2, 64)) is None


def test_gguf_of_mixed_types_keeps_repackable_matrices_packed(tmp_path, monkeypatch):
    """A file mx.load cannot read (K-quants), as llama.cpp's Q4_K_M files mix types, keeps its
    Q4_K / Q5_K / Q4_0 / Q5_0 / Q8_0 matrices packed and computes what the same file
    dequantized whole computes; the Q6_K matrix is dequantized."""
    config = dict(CONFIG, hidden_size=256, intermediate_size=256)  # rows of K-quants' 256
    T = gguf.GGMLQuantizationType
    kinds = {"ffn_down": T.Q4_K, "ffn_up": T.Q5_K, "attn_v": T.Q6_K, "attn_q": T.Q4_0, "attn_k": T.Q5_0}

    def encode(name, a):
        if a.ndim != 2:
            return None
        qtype = next((t for stem, t in kinds.items() if f".{stem}." in name), T.Q8_0)
        if qtype.name.endswith("_K"):
            return k_quant_blocks(*a.shape, qtype), qtype
        return gguf.quants.quantize(a, qtype), qtype

    path = write_gguf(tmp_path / "mixed.gguf", random_model(config), config, "llama", encode)
    loaded, _ = load_gguf_model(path, dtype=mx.float32)
    layer = loaded.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    bits = [m.bits for m in (mlp.down_proj, mlp.up_proj, attn.q_proj, attn.k_proj, mlp.gate_proj)]
    assert bits == [4, 8, 4, 8, 8]
    assert isinstance(loaded.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(layer.self_attn.v_proj) is nn.Linear
    monkeypatch.setattr(gguf_loading, "affine_from_gguf", lambda *a: None)
    dense, _ = load_gguf_model(path, dtype=mx.float32)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dense.named_modules())
    x = prompt_ids()
    want = dense(x)
    assert mx.abs(loaded(x) - want).max().item() < 1e-4 * mx.abs(want).max().item()


def sentencepiece_vocabulary(w: gguf.GGUFWriter) -> None:
    """A llama-style (sentencepiece) vocabulary of VOCAB tokens: specials, byte tokens, pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(16)]
    tokens += ["\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\u2581ab", "ba", "\u2581c"]
    tokens += [f"w{i}" for i in range(VOCAB - len(tokens))]
    pieces = len(tokens) - 19
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 19 + [-float(i) for i in range(pieces)])
    w.add_token_types([2, 3, 3] + [6] * 16 + [1] * pieces)  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def test_gguf_sentencepiece_tokenizer_is_transformers_own(tmp_path):
    """A non-BPE vocabulary goes through transformers' GGUF converter: the tokenizer encodes and
    decodes as `AutoTokenizer.from_pretrained(gguf_file=...)` builds it from the same file."""
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "s.gguf", random_model(), CONFIG, "llama", metadata=sentencepiece_vocabulary)
    _, tok = ts.load(path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["a b c", "ab ba abc", " c", "xyz", ""]:
        ids = tok.encode(text)
        assert ids == auto.encode(text) and ids[0] == 1, text
        assert tok.decode(ids) == auto.decode(ids)
    assert 2 in tok.eos_token_ids


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(np.array(unpermute_rows(mx.array(permute_like_llama_cpp(w, 4)), 4)), w)


# -- bad input -------------------------------------------------------------------------


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        ts.load(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="neither a file"):
        ts.load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ts.load(tmp_path / "empty")
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ts.load(d)


def test_unsupported_family_names_supported(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"'bert' is not supported.*llama.*qwen2.*qwen3"):
        ts.load(d)


def test_corrupted_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", random_model(), CONFIG, "llama")
    data = path.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or damaged"):
        ts.load(tmp_path / "trunc.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        ts.load(tmp_path / "junk.gguf")


def test_prompt_longer_than_context(tmp_path):
    model, tok = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    prompt = " ".join(["w5"] * 70)  # 70 tokens, the model's context is 64
    with pytest.raises(ValueError, match="context of 64"):
        ts.generate(model, tok, prompt, kv="tq4", max_tokens=4)
    with pytest.raises(ValueError, match="context of 64"):
        ts.generate(model, tok, " ".join(["w5"] * 60), kv="tq4", max_tokens=8)


def test_generate_on_tiny_model(tmp_path):
    """Greedy generate equals argmax steps of the model with the same cache preset; stop strings cut text."""
    model, tok = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    prompt = "w1 w2 w3 w4 w5"
    ids = tok.encode(prompt)
    responses = list(ts.stream_generate(model, tok, prompt, kv="k8v4", max_tokens=6, stop_tokens=[]))
    cache = ts.make_cache(model, kv="k8v4")
    x, want = mx.array([ids]), []
    for _ in range(6):
        nxt = mx.argmax(model(x, cache=cache)[0, -1]).item()
        want.append(nxt)
        x = mx.array([[nxt]])
    assert [r.token for r in responses] == want
    last = responses[-1]
    assert last.finish_reason == "length" and last.generation_tokens == 6 and last.prompt_tokens == len(ids)
    # At a dozen positions a k8v4 layer still holds every row in its FP16 window.
    assert last.kv_bytes > 0 and last.kv_fp16_bytes > 0
    text = "".join(r.text for r in responses)
    assert text == tok.decode(want)
    # a stop string ends generation before it; sampling with a seed repeats
    word = tok.decode(want[2:3]).strip()
    cut = ts.generate(model, tok, prompt, kv="k8v4", max_tokens=6, stop_tokens=[], stop=[word])
    assert word not in cut and text.startswith(cut)
    a = ts.generate(
        model, tok, prompt, kv="tq4", max_tokens=8, temperature=1.0, top_k=20, seed=7, stop_tokens=[]
    )
    b = ts.generate(
        model, tok, prompt, kv="tq4", max_tokens=8, temperature=1.0, top_k=20, seed=7, stop_tokens=[]
    )
    assert a == b


@pytest.mark.parametrize("stop_at", [None, 2])
def test_generate_leaves_the_cache_at_the_tokens_fed(tmp_path, stop_at):
    """Generation computes each next step ahead of reading the token; when it finishes, the
    cache holds the prompt and every emitted token but the last (what was fed back), whether
    it ends by length or by a stop token, and a continuation reads on from there."""
    model, tok = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    ids = tok.encode("w1 w2 w3 w4 w5")
    free = [r.token for r in ts.stream_generate(model, tok, ids, kv="tq4", max_tokens=5, stop_tokens=[])]
    stops = [] if stop_at is None else [free[stop_at]]
    cache = ts.make_cache(model, kv="tq4", max_rows=8)
    out = [r.token for r in ts.stream_generate(model, tok, ids, cache=cache, max_tokens=5, stop_tokens=stops)]
    assert out == (free if stop_at is None else free[: free.index(stops[0]) + 1])
    assert cache.offset == len(ids) + len(out) - 1
    more = list(ts.stream_generate(model, tok, [out[-1]], cache=cache, max_tokens=2, stop_tokens=[]))
    assert cache.offset == len(ids) + len(out) + 1 and len(more) == 2


def test_generate_takes_a_config_object(tmp_path):
    """kv= takes a TurboQuantConfig too; its layer policy shapes the cache generation uses."""
    model, tok = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    config = ts.PRESETS["tq3"].with_(fp16_first=1)
    last = list(ts.stream_generate(model, tok, "w1 w2", kv=config, max_tokens=3, stop_tokens=[]))[-1]
    assert last.kv == config.name and last.generation_tokens == 3
    cache = ts.make_cache(model, kv=config)
    assert cache.layer_quant(0) is None and cache.layer_quant(1).k.bits == 3


@pytest.mark.parametrize("kv", ["fp16", "tq4"])
def test_speculative_decoding_gives_the_models_tokens(tmp_path, kv):
    """A draft model proposes, the model decides: greedy tokens equal plain generation's whatever
    the draft (an unrelated one, or the model itself, whose every proposal is accepted), and
    the cache ends at the tokens fed back, also when generation stops inside accepted drafts."""
    config = dict(CONFIG, max_position_embeddings=256)
    model = varied_model(config)
    tok = ts.load(write_hf_dir(tmp_path / "m", model, config))[1]
    unrelated = random_model(dict(config, num_hidden_layers=1), seed=5)
    ids = tok.encode("w1 w2 w3 w4 w5 w6 w7")
    plain_run = [r.token for r in ts.stream_generate(model, tok, ids, kv=kv, max_tokens=40, stop_tokens=[])]
    assert len(set(plain_run)) > 10
    for draft, n in [(unrelated, 3), (model, 4)]:
        out = list(ts.stream_generate(model, tok, ids, kv=kv, max_tokens=40, stop_tokens=[], draft_model=draft,
                                      num_draft_tokens=n))
        assert [r.token for r in out] == plain_run
        accepted = sum(r.from_draft for r in out)
        assert (accepted == 39 - 39 // (n + 1)) if draft is model else (accepted < 20)
    # Stops inside a run of accepted drafts (stop token / length): the cache holds what was fed.
    for stop_at, max_tokens in [(6, 40), (None, 7)]:
        cache = ts.make_cache(model, kv=kv, max_rows=16)
        stops = [] if stop_at is None else [plain_run[stop_at]]
        out = [r.token for r in ts.stream_generate(model, tok, ids, cache=cache, max_tokens=max_tokens,
                                                   stop_tokens=stops, draft_model=model, num_draft_tokens=4)]
        assert out == plain_run[: len(out)]
        assert cache.offset == len(ids) + len(out) - 1
    with pytest.raises(ValueError, match="vocabulary"):
        next(ts.stream_generate(model, tok, ids, draft_model=random_model(dict(config, vocab_size=80))))


def test_cpu_weights_column_major(tmp_path):
    """On the CPU, float32 Linear / Embedding weights with more outputs than inputs are kept
    as transposes of (in, out) arrays (MKL's one-row product reads them faster that way), the
    others as stored: same values, same logits."""
    model = random_model()
    path = write_hf_dir(tmp_path / "m", model)
    loaded, _ = ts.load(path)
    seen = set()
    for name, m in loaded.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            rows, cols = m.weight.shape
            column_major = rows > cols
            seen.add(column_major)
            want = (4, 4 * rows) if column_major else (4 * cols, 4)
            assert memoryview(m.weight).strides == want, name
    assert seen == {True, False}  # the model has both kinds (gate/up_proj: 96 x 64; down_proj: 64 x 96)
    flat = dict(tree_flatten(model.parameters()))
    for name, p in tree_flatten(loaded.parameters()):
        assert mx.array_equal(p, flat[name]).item(), name
    x = prompt_ids()
    want = model(x)
    assert mx.abs(loaded(x) - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    lazy, _ = ts.load(path, lazy=True)  # lazy loads leave the layout as stored
    assert memoryview(lazy.model.layers[0].mlp.up_proj.weight).strides == (4 * 64, 4)
