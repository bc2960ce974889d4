"""GGUF files: tensors through `mx.load` (F32/F16/BF16/Q4_0/Q4_1/Q8_0 natively; the quantized
ones stay packed as MLX affine weights, group size 32) or, for files with other types
(K-quants, Q5_0, ...), through the `gguf` package: there the matrices of the types in
`AFFINE_BLOCKS` are repacked, exactly, into MLX's affine 4- and 8-bit layout
(`affine_from_gguf`) and the other types (Q6_K, ...) dequantized; llama.cpp's tensor names
and metadata keys mapped onto the family files by `GGUF_ARCHITECTURES`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..models import get_model_classes
from .gguf_layout import GGUFLayout, read_layout
from .tokenizers import gguf_tokenizer, meta_value

GGUF_GROUP_SIZE = 32  # Q4_0 / Q4_1 / Q8_0 blocks, as mx.load returns them


# -- GGUF architectures as data ------------------------------------------------------
# Tensor names: llama.cpp's names -> the HF / mlx-lm names family files use
# ("{i}" is the block index). Config keys: GGUF metadata key (after "<arch>.") -> HF config key.

COMMON_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
QK_NORM_TENSORS = {
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
}
COMMON_CONFIG = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF `general.architecture` maps onto a family file.

    Attributes:
        model_type: the HF model_type (a family file or remap entry).
        tensors: llama.cpp tensor-name stem -> HF name stem.
        config: metadata key (after "<arch>.") -> HF config key.
        permute_qk: llama.cpp's converter reorders Q/K rows for its interleaved
            RoPE on this architecture; undo it to get HF's half-split layout.
        norm_shift: added to norm weights at conversion (gemma's 1 + w norms); subtracted here.
        extra_config: fixed HF config entries.
        config_defaults: "module:function" filling config values llama.cpp does not
            store (the family's own knowledge, kept in its file).
    """

    model_type: str
    tensors: dict[str, str]
    config: dict[str, str] = field(default_factory=lambda: dict(COMMON_CONFIG))
    permute_qk: bool = False
    norm_shift: float = 0.0
    extra_config: dict[str, Any] = field(default_factory=dict)
    config_defaults: str | None = None


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", COMMON_TENSORS, permute_qk=True),
    "qwen2": GGUFArch("qwen2", COMMON_TENSORS),
    "qwen3": GGUFArch("qwen3", {**COMMON_TENSORS, **QK_NORM_TENSORS}),
    "gemma3": GGUFArch(
        "gemma3_text",
        {
            **COMMON_TENSORS,
            **QK_NORM_TENSORS,
            "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
            "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
            "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
        },
        config={**COMMON_CONFIG, "attention.sliding_window": "sliding_window"},
        norm_shift=1.0,
        config_defaults="gemma3_text:gguf_config_defaults",
    ),
}


def load_gguf(path: Path, *, dtype: mx.Dtype | None = None, lazy: bool = False):
    """(model, tokenizer) from a GGUF file; see `load`."""
    model, meta = load_gguf_model(path, dtype=dtype, lazy=lazy)
    return model, gguf_tokenizer(Path(path), meta)


def load_gguf_model(path: Path, *, dtype: mx.Dtype | None = None, lazy: bool = False):
    """(model, metadata) from a GGUF file, without building the tokenizer."""
    path = Path(path)
    tensors, meta = read_gguf(path)
    arch_name = _meta_str(meta, "general.architecture", path)
    arch = GGUF_ARCHITECTURES.get(arch_name)
    if arch is None:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch_name!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    try:
        config = gguf_config(meta, arch_name, arch, tensors)
        Model, ModelArgs = get_model_classes(config["model_type"])
        model = Model(ModelArgs.from_dict(config))
        weights = gguf_to_hf_weights(tensors, arch, config)
    except KeyError as e:  # a metadata key or tensor the architecture needs
        raise ValueError(f"{path.name}: the GGUF lacks {e} that a {arch_name} model needs (damaged file?)") from None

    if "rope_freqs.weight" in tensors:
        if not all(hasattr(getattr(l, "self_attn", None), "rope") for l in model.layers):
            raise ValueError(
                f"{path.name}: rope_freqs given, but the {arch_name} family has no per-layer RoPE"
            )
        for l in model.layers:
            l.self_attn.rope = FactorRoPE(
                config["head_dim"], config["rope_theta"], tensors["rope_freqs.weight"]
            )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if dtype is None:
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    quant = _quantized_modules(weights)
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
    missing = {k for k, _ in tree_flatten(model.parameters())} - set(weights)
    if missing:
        raise ValueError(
            f"{path.name}: GGUF lacks tensors the {arch_name} model needs: {sorted(missing)[:5]}"
        )
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model, meta


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file.

    mx.load reads float and Q4_0/Q4_1/Q8_0 tensors (quantized ones as packed weight + scales +
    biases); a file with other types is read here (`gguf_layout`), its matrices repacked
    (`affine_from_gguf`) or dequantized to float32 by the gguf package.
    """
    layout = check_gguf_layout(path)
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:
        mlx_error = e  # types mx.load does not read (K-quants, Q5_*, ...) or a damaged file
    return _read_gguf_without_mx_load(layout, mlx_error)


def check_gguf_layout(path: Path) -> GGUFLayout:
    """The header, metadata and tensor table of a GGUF file, checked against the file's size
    before anything maps it: mx.load trusts the counts and offsets, and a damaged count crashed
    the process (SIGSEGV) instead of raising."""
    return read_layout(path)


def _read_gguf_without_mx_load(
    layout: GGUFLayout, mlx_error: Exception
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = layout.path
    meta = {k: mx.array(v) if isinstance(v, (int, float, bool)) else v for k, v in layout.metadata.items()}
    tensors = {}
    try:
        for t in layout.tensors:
            qtype, data = GGMLQuantizationType(t.ggml_type), layout.tensor_bytes(t)
            packed = affine_from_gguf(data, qtype, t.shape)
            if packed is not None and t.name.endswith(".weight"):
                stem = t.name[: -len(".weight")]
                tensors[t.name], tensors[f"{stem}.scales"], tensors[f"{stem}.biases"] = map(mx.array, packed)
                continue
            values = np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
            tensors[t.name] = mx.array(values.reshape(t.shape))
    except Exception as e:
        raise ValueError(
            f"cannot read GGUF file {path}: it is truncated or damaged (mx.load: {mlx_error}; gguf: {e})"
        ) from None
    return tensors, meta


# GGUF block types repacked into MLX's affine layout: type -> (bytes per block, MLX bits). The
# 5-bit types are widened to 8 bits: the CPU kernels read 4 and 8 (cpu_ext).
AFFINE_BLOCKS = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q4_K": (144, 4), "Q8_0": (34, 8),
                 "Q5_0": (22, 8), "Q5_1": (24, 8), "Q5_K": (176, 8)}  # fmt: skip


def affine_from_gguf(data: np.ndarray, qtype, shape: tuple[int, ...]) -> tuple[np.ndarray, ...] | None:
    """A GGUF matrix of `AFFINE_BLOCKS` as MLX affine weights, group size 32: (packed uint32
    (out, in * bits / 32), scales, biases (out, in / 32), float32), each weight scale * q + bias
    equal to llama.cpp's own dequantization of it. None for other types and shapes. (A K-quant's
    32-weight sub-blocks carry a scale d·sc and a minimum dmin·m, as MLX's groups do.)"""
    from gguf.quants import Q4_K

    name = getattr(qtype, "name", None)
    if len(shape) != 2 or name not in AFFINE_BLOCKS:
        return None
    block_bytes, bits = AFFINE_BLOCKS[name]
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes)

    def f16(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # 16 bytes -> 32 values: low nibbles, then high
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    def high_bits(qh: np.ndarray) -> np.ndarray:  # 4 bytes -> bit i of the word is value i's 5th bit
        word = np.ascontiguousarray(qh).view(np.uint32)
        return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4

    def k_quant(codes: np.ndarray) -> tuple[np.ndarray, ...]:  # 8 sub-blocks of 32 per block
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        d, dmin = f16(b[:, :2]), f16(b[:, 2:4])
        return codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))

    def k_nibbles(qs: np.ndarray) -> np.ndarray:  # 32 bytes hold two sub-blocks, low nibbles first
        return (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F

    if name == "Q8_0":
        d = f16(b[:, :2])
        q, scales, biases = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d
    elif name == "Q4_0":
        d = f16(b[:, :2])
        q, scales, biases = nibbles(b[:, 2:]), d, -8 * d
    elif name == "Q4_1":
        q, scales, biases = nibbles(b[:, 4:]), f16(b[:, :2]), f16(b[:, 2:4])
    elif name == "Q5_0":
        d = f16(b[:, :2])
        q, scales, biases = nibbles(b[:, 6:]) | high_bits(b[:, 2:6]), d, -16 * d
    elif name == "Q5_1":
        q, scales, biases = nibbles(b[:, 8:]) | high_bits(b[:, 4:8]), f16(b[:, :2]), f16(b[:, 2:4])
    elif name == "Q4_K":
        q, scales, biases = k_quant(k_nibbles(b[:, 16:]))
    else:  # Q5_K: bit s of byte j of qh is the 5th bit of value j of sub-block s
        qh = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q, scales, biases = k_quant(k_nibbles(b[:, 48:]).reshape(-1, 8, 32) | (qh << 4))
    out, n_in = shape
    per_word = 32 // bits
    q = q.reshape(out, n_in // per_word, per_word).astype(np.uint32)
    packed = np.bitwise_or.reduce(q << (bits * np.arange(per_word, dtype=np.uint32)), axis=-1)
    groups = (out, n_in // 32)
    return packed, scales.reshape(groups), biases.reshape(groups)


def _meta_str(meta: dict, key: str, path: Path) -> str:
    if key not in meta:
        raise ValueError(f"{path.name}: GGUF metadata has no {key!r}")
    return str(meta[key])


def gguf_config(meta: dict, arch_name: str, arch: GGUFArch, tensors: dict) -> dict:
    """An HF-style config dict from GGUF metadata."""
    config = {"model_type": arch.model_type, **arch.extra_config}
    for key, hf_key in arch.config.items():
        if f"{arch_name}.{key}" in meta:
            config[hf_key] = meta_value(meta[f"{arch_name}.{key}"])
    if "vocab_size" not in config and "token_embd.weight" in tensors:
        config["vocab_size"] = tensors["token_embd.weight"].shape[0]  # llama.cpp may drop unused rows
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if "head_dim" not in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config["tie_word_embeddings"] = "output.weight" not in tensors
    scaling = str(meta.get(f"{arch_name}.rope.scaling.type", "none"))
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": meta_value(meta[f"{arch_name}.rope.scaling.factor"]),
        }
    elif scaling != "none":
        raise ValueError(
            f"GGUF RoPE scaling {scaling!r} is not supported; load the model's Hugging Face directory instead"
        )
    if arch.config_defaults:
        module, func = arch.config_defaults.split(":")
        config = getattr(importlib.import_module(f"turbospark_mlx.models.{module}"), func)(config)
    return config


class FactorRoPE(nn.Module):
    """RoPE with llama.cpp's per-frequency factors (`rope_freqs.weight`: how GGUF stores Llama 3.1 scaling).

    llama.cpp rotates pair i by pos * base^(-2i/d) / factor_i; mx.fast.rope takes the periods
    base^(2i/d) * factor_i, as mlx-lm's Llama3RoPE passes them.
    """

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def gguf_to_hf_weights(tensors: dict[str, mx.array], arch: GGUFArch, config: dict) -> dict[str, mx.array]:
    """Rename llama.cpp tensors to HF names, undo the Q/K row permutation and norm shift."""
    patterns = []
    for stem, hf in arch.tensors.items():
        rx = re.escape(stem).replace(re.escape("{i}"), r"(\d+)")
        patterns.append((re.compile(rf"^{rx}\.(weight|bias|scales|biases)$"), hf))
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for name, a in tensors.items():
        if name == "rope_freqs.weight":
            continue
        for rx, hf in patterns:
            m = rx.match(name)
            if m:
                break
        else:
            raise ValueError(f"GGUF tensor {name!r} has no mapping for this architecture")
        *idx, part = m.groups()
        hf_name = (hf.format(i=idx[0]) if idx else hf) + "." + part
        if arch.permute_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            a = unpermute_rows(a, n_heads if ".q_proj." in hf_name else n_kv)
        if arch.norm_shift and hf_name.endswith("norm.weight"):
            a = a - arch.norm_shift
        out[hf_name] = a
    return out


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order (pairs interleaved per head) back to HF's (halves).

    llama.cpp's converter does w.reshape(H, 2, D/2, ...).swapaxes(1, 2); this is the inverse.
    Rows only, so packed quantized weights, scales and biases permute the same way.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized_modules(weights: dict[str, mx.array]) -> dict[str, dict]:
    """Module path -> {group_size, bits} for every packed weight (GGUF blocks of 32)."""
    quant = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            in_features = w.shape[-1] * GGUF_GROUP_SIZE
            bits = weights[f"{module}.weight"].shape[-1] * 32 // in_features
            quant[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return quant
