"""Attention conversion and the entry points of the mlx-lm drop-in.

What `make_prompt_cache` does (nothing happens at import):
  * It builds mlx-lm's own per-layer cache list (`model.make_cache()` or `KVCache` per
    layer) and replaces every full-attention `KVCache` that the preset's layer policy
    compresses with a `TurboSparkKVCache`. Sliding-window `RotatingKVCache`,
    `ArraysCache` and the rest stay as they are.
  * It converts the attention modules of `model.layers` in place by giving each
    `self_attn` object a subclass of its own class whose `__call__` sends a TurboSpark
    cache through the write path and `attention_any` (packed codes, sinks, `kv_start`).
    Parameters are the same objects; any other cache goes to the original `__call__`.
    `unpatch_model(model)` gives every object its class back.
  * It registers the cache class names in `mlx_lm.models.cache`, which is how
    `mlx_lm.load_prompt_cache` finds classes (a lookup in that module's globals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..quant.config import DEFAULT_PRESET, TurboQuantConfig, get_preset, warn_quality
from .cache import TurboSparkBatchKVCache, TurboSparkKVCache

_CACHE_CLASSES = (TurboSparkKVCache, TurboSparkBatchKVCache)


def register_cache_classes() -> None:
    """Make `mlx_lm.load_prompt_cache` able to re-create TurboSpark caches.

    mlx-lm resolves a saved cache's class name in `mlx_lm.models.cache`'s
    globals; this adds the TurboSpark names there (nothing else changes).
    `make_prompt_cache` and `patch_model` call it.
    """
    from mlx_lm.models import cache

    for cls in _CACHE_CLASSES:
        setattr(cache, cls.__name__, cls)


# Where `save_prompt_cache` puts its SHA-256 digest: a key of the user-metadata dict in
# mlx-lm's flattened file metadata ([metadata, classes, scalars]).
DIGEST_KEY = "0.turbospark_digest"


def save_prompt_cache(file_name: str, cache: list, metadata: dict[str, str] | None = None) -> None:
    """`mlx_lm.save_prompt_cache`'s file, with a SHA-256 digest of its tensors and metadata,
    written atomically (temporary file, fsync, rename): `load_prompt_cache` refuses a file
    whose bytes changed, and an interrupted save leaves the previous file in place."""
    import os
    import tempfile

    from mlx_lm.models.cache import save_prompt_cache as _save

    from ..cache.io import atomic_save_safetensors, digest

    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=os.path.dirname(os.path.abspath(file_name)))
    os.close(fd)
    try:
        _save(tmp, cache, metadata)  # mlx-lm's own layout, then re-read to hash exactly what it wrote
        tensors, meta = mx.load(tmp, return_metadata=True)
    finally:
        os.unlink(tmp)
    meta[DIGEST_KEY] = digest(tensors, meta)
    atomic_save_safetensors(file_name, tensors, meta)


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """`mlx_lm.load_prompt_cache` after `register_cache_classes()`, for files in mlx-lm's format.

    The file's header is checked before MLX reads it, and a file written by
    `save_prompt_cache` must match its digest: damage is a ValueError naming the file,
    and nothing is loaded. (A file saved by stock `mlx_lm.save_prompt_cache` has no digest,
    so only its header can be checked.)
    """
    from pathlib import Path

    from mlx_lm.models.cache import load_prompt_cache as _load

    from ..cache.io import digest
    from ..loading.hf import check_safetensors

    register_cache_classes()
    check_safetensors(Path(file_name))
    try:
        tensors, meta = mx.load(file_name, return_metadata=True)
    except Exception as e:  # MLX's own error for what the header check cannot see
        raise ValueError(f"cannot read prompt-cache file {file_name}: {e}") from None
    want = meta.pop(DIGEST_KEY, None)
    if want is not None and digest(tensors, meta) != want:
        raise ValueError(f"prompt-cache file {file_name} does not match its digest: the file is damaged")
    cache, metadata = _load(file_name, return_metadata=True)
    metadata.pop(DIGEST_KEY.split(".", 1)[1], None)
    return (cache, metadata) if return_metadata else cache


# -- attention conversion ---------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """Where an mlx-lm attention module keeps what the TurboSpark path needs."""

    n_heads: str
    n_kv_heads: str
    scale: str
    norms: bool = False  # q_norm / k_norm over head_dim before RoPE
    sinks: str | None = None


# Attention classes by "module.Class"; each family's __call__ as written in mlx-lm 0.31.3 and 0.32.2.
_FAMILIES = {
    "mlx_lm.models.llama.Attention": _Family("n_heads", "n_kv_heads", "scale"),
    "mlx_lm.models.qwen2.Attention": _Family("n_heads", "n_kv_heads", "scale"),
    "mlx_lm.models.qwen3.Attention": _Family("n_heads", "n_kv_heads", "scale", norms=True),
    "mlx_lm.models.gemma3_text.Attention": _Family("n_heads", "n_kv_heads", "scale", norms=True),
    "mlx_lm.models.gpt_oss.AttentionBlock": _Family(
        "num_attention_heads", "num_key_value_heads", "sm_scale", sinks="sinks"
    ),
}
_CONVERTED: dict[type, type] = {}  # original attention class -> its TurboSpark subclass


def _family_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _turbospark_call(self, x: mx.array, mask=None, cache=None):
    """Attention forward: TurboSpark caches go through attend(); any other cache to the original."""
    cls = type(self)
    if not isinstance(cache, _CACHE_CLASSES):
        return cls._turbospark_original.__call__(self, x, mask, cache)
    fam = cls._turbospark_family
    B, L, _ = x.shape
    q = self.q_proj(x).reshape(B, L, getattr(self, fam.n_heads), -1).transpose(0, 2, 1, 3)
    k = self.k_proj(x).reshape(B, L, getattr(self, fam.n_kv_heads), -1).transpose(0, 2, 1, 3)
    v = self.v_proj(x).reshape(B, L, getattr(self, fam.n_kv_heads), -1).transpose(0, 2, 1, 3)
    if fam.norms:
        q, k = self.q_norm(q), self.k_norm(k)
    # The mask is not needed: attend() masks causally by position and skips padding rows.
    offset = cache.offset
    q = self.rope(q, offset=offset)
    k = self.rope(k, offset=offset)
    sinks = getattr(self, fam.sinks) if fam.sinks else None
    out = cache.attend(q, k, v, scale=getattr(self, fam.scale), sinks=sinks)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _converted_class(original: type) -> type:
    if original not in _CONVERTED:
        _CONVERTED[original] = type(
            f"TurboSpark{original.__name__}",
            (original,),
            {
                "__call__": _turbospark_call,
                "_turbospark_original": original,
                "_turbospark_family": _FAMILIES[_family_key(original)],
                "__module__": __name__,
            },
        )
    return _CONVERTED[original]


def _attention_modules(model) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__module__}.{type(model).__name__} has no `layers`; not an mlx-lm model?"
        )
    return [getattr(layer, "self_attn", None) for layer in layers]


def _is_converted(attn) -> bool:
    return attn is not None and hasattr(type(attn), "_turbospark_original")


def _convert_attention(model, need: Sequence[int]) -> None:
    """Give the attention modules of the layers in `need` (and every supported one) the TurboSpark call."""
    modules = _attention_modules(model)
    for i in need:
        attn = modules[i]
        if attn is None or not (_is_converted(attn) or _family_key(type(attn)) in _FAMILIES):
            what = "no self_attn" if attn is None else _family_key(type(attn))
            raise NotImplementedError(
                f"layer {i}: turbospark_mlx cannot serve this attention ({what}); supported: "
                f"{', '.join(sorted(_FAMILIES))}. Use mlx-lm's own cache for this model."
            )
    for attn in modules:
        if attn is not None and not _is_converted(attn) and _family_key(type(attn)) in _FAMILIES:
            attn.__class__ = _converted_class(type(attn))


def _base_caches(model) -> list:
    from mlx_lm.models.cache import KVCache

    if "_turbospark_make_cache" in vars(model):  # patched: the model's own make_cache, or None
        own = model._turbospark_make_cache
    else:
        own = getattr(model, "make_cache", None)
    return own() if own is not None else [KVCache() for _ in model.layers]


def make_prompt_cache(
    model,
    kv: str | TurboQuantConfig = DEFAULT_PRESET,
    *,
    max_rows: int = 256,
    q_block: int = 256,
    dtype: str | None = None,
    max_kv_size: int | None = None,
) -> list:
    """mlx-lm's prompt cache for `model` with TurboQuant on the full-attention layers.

    Builds the list mlx-lm would (`model.make_cache()` or one `KVCache` per
    layer) and replaces each `KVCache` on a layer the preset's policy
    compresses (`TurboQuantConfig.is_quantized_layer`) with a
    `TurboSparkKVCache`; RotatingKVCache, ArraysCache and the rest stay. It
    also converts the model's attention modules (see `unpatch_model` to undo)
    and registers the cache classes with mlx-lm's loader.

    Args:
        model: an mlx-lm model (llama/mistral, qwen2, qwen3, gemma3/gemma3_text, gpt_oss).
        kv: preset name or `TurboQuantConfig`.
        max_rows, q_block, dtype: see `TurboSparkKVCache`.
        max_kv_size: bound every full-attention layer to its first and newest positions:
            bounded TurboSpark caches on the compressed layers, `RotatingKVCache(max_kv_size,
            keep=4)` (what `mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)` builds)
            for each `KVCache` the preset keeps FP16. Unlike mlx-lm's, which ignores the
            bound for a model with its own `make_cache` (llama, qwen3, gemma3 in 0.32), the
            bound holds for every model. Sliding-window caches stay as they are.
    Raises:
        NotImplementedError: a layer to compress has an attention module this
            package cannot serve (the model is left unchanged).
    """
    from mlx_lm.models.cache import KVCache

    config = get_preset(kv)
    warn_quality(config)
    base = _base_caches(model)
    if max_kv_size is not None:
        TurboSparkKVCache(config, max_kv_size=max_kv_size)  # the bound checked before the model changes
    n = len(base)
    if n != len(model.layers):
        raise ValueError(f"the model's cache list has {n} entries for {len(model.layers)} layers")
    chosen = [i for i, c in enumerate(base) if type(c) is KVCache and config.is_quantized_layer(i, n)]
    _convert_attention(model, chosen)
    register_cache_classes()
    for i in chosen:
        base[i] = TurboSparkKVCache(
            config, max_rows=max_rows, q_block=q_block, dtype=dtype, max_kv_size=max_kv_size
        )
    if max_kv_size is not None:
        from mlx_lm.models.cache import RotatingKVCache

        base = [RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c for c in base]
    return base


def patch_model(model, kv: str | TurboQuantConfig = DEFAULT_PRESET, **kwargs):
    """Make every cache mlx-lm builds for `model` a TurboSpark one; returns the model.

    Sets an instance attribute `model.make_cache`, which mlx-lm's
    `make_prompt_cache` prefers: `generate_step` without a prompt_cache,
    speculative decoding's draft model, `BatchGenerator` / `batch_generate`
    and `mlx_lm.server` then all get TurboSpark caches. Undo with `unpatch_model`.
    """
    make_prompt_cache(model, kv, **kwargs)  # validates and converts before anything is set
    if "_turbospark_make_cache" not in vars(model):
        model._turbospark_make_cache = getattr(model, "make_cache", None)  # None: mlx-lm's default list
    model.make_cache = lambda: make_prompt_cache(model, kv, **kwargs)
    return model


def unpatch_model(model):
    """Undo `make_prompt_cache` / `patch_model` on `model`: original attention classes and make_cache."""
    for attn in _attention_modules(model):
        if _is_converted(attn):
            attn.__class__ = type(attn)._turbospark_original
    if "_turbospark_make_cache" in vars(model):
        del model.make_cache  # the instance attribute; the class's method (if any) shows again
        del model._turbospark_make_cache
    return model
