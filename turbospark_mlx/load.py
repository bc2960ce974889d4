"""Load a model and its tokenizer: a local HF directory, an HF repo id, or a GGUF file.

HF directories go through mlx-lm's loader (safetensors, sharded, mlx-community
quantized weights) with this package's family classes. GGUF files are read with
`mx.load` (F32/F16/BF16/Q4_0/Q4_1/Q8_0 natively; the quantized ones stay packed
as MLX affine weights, group size 32) or, for other types (K-quants, ...), with
the `gguf` package, which dequantizes them. The tokenizer and chat template come
from the GGUF metadata through transformers' GGUF converter.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .models import get_model_classes

# What an HF repo id download fetches: weights, configs, tokenizer files.
HF_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jinja",
]
GGUF_MAGIC = b"GGUF"
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


# -- entry point ---------------------------------------------------------------------


def load(
    path_or_repo: str | os.PathLike,
    *,
    revision: str | None = None,
    dtype: mx.Dtype | None = None,
    lazy: bool = False,
) -> tuple[nn.Module, Any]:
    """Load (model, tokenizer) from a GGUF file, a local HF directory or an HF repo id.

    Args:
        path_or_repo: a `.gguf` file; a directory with config.json and *.safetensors;
            or "org/name" on the Hugging Face Hub (honours HF_HUB_OFFLINE and the local cache).
        revision: HF branch, tag or commit (repo ids only).
        dtype: dtype of float weights and activations. Default: float32 on the CPU (MLX's
            CPU float16/bfloat16 matmuls measured ~50x slower here); on a GPU, as stored for
            HF checkpoints and float16 for GGUF.
        lazy: leave weights unevaluated until first use.
    Returns:
        (model, tokenizer): a family `Model` and an mlx-lm `TokenizerWrapper`.
    Raises:
        FileNotFoundError: a path, config, weight file or shard is missing.
        ValueError: unsupported model type or GGUF architecture, or an unreadable file.
    """
    path = Path(path_or_repo).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return load_gguf(path, dtype=dtype, lazy=lazy)
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype, lazy=lazy)
    if _looks_like_repo_id(str(path_or_repo)):
        return load_hf_dir(_snapshot(str(path_or_repo), revision), dtype=dtype, lazy=lazy)
    raise FileNotFoundError(
        f"{str(path_or_repo)!r} is neither a file, a directory, nor a Hugging Face repo id (org/name)"
    )


def _looks_like_repo_id(s: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not s.startswith((".", "/"))


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """Download (or find in the local HF cache) the files a model needs."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HF_ALLOW_PATTERNS))
    except Exception as e:  # offline without a cached copy, unknown repo, no network, ...
        raise FileNotFoundError(
            f"could not get {repo_id!r} from the Hugging Face Hub or its local cache: {type(e).__name__}: {e}"
        ) from e


# -- HF directories ------------------------------------------------------------------


def load_hf_dir(path: Path, *, dtype: mx.Dtype | None = None, lazy: bool = False):
    """(model, tokenizer) from an HF-style directory; see `load`."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = json.loads((path / "config.json").read_text())
    if "model_type" not in config:
        raise ValueError(f"{path / 'config.json'} has no model_type")
    get_model_classes(config["model_type"])  # unsupported families fail here, naming the supported ones
    _check_weight_files(path)
    model, config = load_model(
        path, lazy=True, get_model_classes=lambda config: get_model_classes(config["model_type"])
    )
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = mx.float32
    if dtype is not None:
        _cast_floats(model, dtype)
    if not lazy:
        mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


def _check_weight_files(path: Path) -> None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}"
            )
    elif not list(path.glob("model*.safetensors")):
        raise FileNotFoundError(f"{path} has no model*.safetensors weight files")


def _cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast float parameters (not packed weights, which are uint32) to dtype."""
    model.update(
        nn.utils.tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()
        )
    )


# -- GGUF ------------------------------------------------------------------------------


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
    config = gguf_config(meta, arch_name, arch, tensors)
    Model, ModelArgs = get_model_classes(config["model_type"])
    model = Model(ModelArgs.from_dict(config))

    if "rope_freqs.weight" in tensors:
        if not all(hasattr(getattr(l, "self_attn", None), "rope") for l in model.layers):
            raise ValueError(
                f"{path.name}: rope_freqs given, but the {arch_name} family has no per-layer RoPE"
            )
        for l in model.layers:
            l.self_attn.rope = FactorRoPE(
                config["head_dim"], config["rope_theta"], tensors["rope_freqs.weight"]
            )
    weights = gguf_to_hf_weights(tensors, arch, config)
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

    mx.load reads float and Q4_0/Q4_1/Q8_0 tensors (quantized ones as packed
    weight + scales + biases); a file with other types is read with the gguf
    package, which dequantizes them to float32.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:
        mlx_error = e  # types mx.load does not read (K-quants, Q5_*, ...) or a damaged file
    return _read_gguf_with_gguf_package(path, mlx_error)


def _read_gguf_with_gguf_package(
    path: Path, mlx_error: Exception
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise ImportError(
            f"mx.load cannot read {path.name} ({mlx_error}); the gguf package reads more tensor types: "
            "pip install gguf"
        ) from None
    try:
        reader = gguf.GGUFReader(str(path))
        meta = {}
        for name, f in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            value = f.contents()
            meta[name] = mx.array(value) if isinstance(value, (int, float, bool)) else value
        tensors = {}
        for t in reader.tensors:
            data = dequantize(t.data, t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape))  # GGML lists the fastest dimension first
            tensors[t.name] = mx.array(np.ascontiguousarray(data, dtype=np.float32).reshape(shape))
    except Exception as e:
        raise ValueError(
            f"cannot read GGUF file {path}: it is truncated or corrupted (mx.load: {mlx_error}; gguf: {e})"
        ) from None
    return tensors, meta


def _meta_str(meta: dict, key: str, path: Path) -> str:
    if key not in meta:
        raise ValueError(f"{path.name}: GGUF metadata has no {key!r}")
    return str(meta[key])


def _meta_value(v):
    if isinstance(v, mx.array):
        return v.item() if v.size == 1 else v.tolist()
    return v


def gguf_config(meta: dict, arch_name: str, arch: GGUFArch, tensors: dict) -> dict:
    """An HF-style config dict from GGUF metadata."""
    config = {"model_type": arch.model_type, **arch.extra_config}
    for key, hf_key in arch.config.items():
        if f"{arch_name}.{key}" in meta:
            config[hf_key] = _meta_value(meta[f"{arch_name}.{key}"])
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
            "factor": _meta_value(meta[f"{arch_name}.rope.scaling.factor"]),
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


# Pre-tokenizer split regexes of byte-level BPE vocabularies, by `tokenizer.ggml.pre`
# (as llama.cpp's llama-vocab.cpp and the models' tokenizer.json files define them).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_PRE_TOKENIZERS: dict[str, list[str]] = {
    "gpt2": [_GPT2_SPLIT],
    "default": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then GPT-2's split
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}
_GGML_TOKEN_CONTROL, _GGML_TOKEN_USER_DEFINED = 3, 4


def gguf_tokenizer(path: Path, meta: dict):
    """An mlx-lm TokenizerWrapper for a GGUF file's vocabulary.

    Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": SmolLM, Llama 3, Qwen) are
    built here with `tokenizers` from the metadata; others go through transformers' GGUF
    converter (which, in transformers 5, needs torch).
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper

    kind = str(meta.get("tokenizer.ggml.model", ""))
    if kind == "gpt2":
        tok = _bpe_tokenizer_from_gguf(path, meta)
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            raise ValueError(
                f"{path.name}: cannot build a {kind!r} tokenizer from the GGUF metadata: {e}"
            ) from e
    detok = {"gpt2": BPEStreamingDetokenizer, "llama": SPMStreamingDetokenizer}.get(kind)
    stop = [
        int(_meta_value(meta[k]))
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta
    ]
    if detok is None:
        return TokenizerWrapper(tok, eos_token_ids=stop)
    return TokenizerWrapper(tok, detok, eos_token_ids=stop)


def _bpe_tokenizer_from_gguf(path: Path, meta: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in BPE_PRE_TOKENIZERS:
        raise ValueError(
            f"{path.name}: BPE pre-tokenizer {pre!r} is not supported; supported: {', '.join(BPE_PRE_TOKENIZERS)}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False)
    )
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in BPE_PRE_TOKENIZERS[pre]]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = [] if types is None else np.array(types).tolist()
    special = [tokens[i] for i, t in enumerate(types) if t in (_GGML_TOKEN_CONTROL, _GGML_TOKEN_USER_DEFINED)]
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(_meta_value(i))]

    bos = token("bos")
    if bos is not None and bool(_meta_value(meta.get("tokenizer.ggml.add_bos_token", False))):
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
