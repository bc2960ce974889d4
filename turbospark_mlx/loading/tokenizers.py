"""Tokenizers from GGUF metadata: byte-level BPE vocabularies built with `tokenizers`,
others through transformers' GGUF converter; wrapped as mlx-lm `TokenizerWrapper`s."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

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


def meta_value(v):
    """A GGUF metadata value as a Python scalar or list (mx.load gives arrays)."""
    if isinstance(v, mx.array):
        return v.item() if v.size == 1 else v.tolist()
    return v


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
        try:
            tok = _converted_tokenizer(path)
        except Exception as e:
            raise ValueError(
                f"{path.name}: cannot build a {kind!r} tokenizer from the GGUF metadata: {e}"
            ) from e
    detok = {"gpt2": BPEStreamingDetokenizer, "llama": SPMStreamingDetokenizer}.get(kind)
    stop = [
        int(meta_value(meta[k]))
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta
    ]
    if detok is None:
        return TokenizerWrapper(tok, eos_token_ids=stop)
    return TokenizerWrapper(tok, detok, eos_token_ids=stop)


def _converted_tokenizer(path: Path):
    """transformers' GGUF tokenizer converter on the file. Its `get_gguf_tokenizer` reads the
    vocabulary with transformers' own struct reader; `AutoTokenizer.from_pretrained(gguf_file=)`
    builds the same tokenizer but first parses the whole file with the gguf package for the
    model's config (~22 s of Gemma-3-270M's load on a 2-core CPU), so it serves only versions
    of transformers without that module."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    architecture, vocabulary, config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


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
        return None if i is None else tokens[int(meta_value(i))]

    bos = token("bos")
    if bos is not None and bool(meta_value(meta.get("tokenizer.ggml.add_bos_token", False))):
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
