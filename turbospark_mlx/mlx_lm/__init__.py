"""Drop-in TurboQuant KV cache for mlx-lm models.

    from turbospark_mlx.mlx_lm import make_prompt_cache
    cache = make_prompt_cache(model, kv="k8v4")
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)

`cache.py` holds the cache classes, `patch.py` the attention conversion and the entry
points; docs/mlx_lm.md describes the adapter.
"""

from .cache import TurboSparkBatchKVCache, TurboSparkKVCache
from .patch import (
    load_prompt_cache,
    make_prompt_cache,
    patch_model,
    register_cache_classes,
    save_prompt_cache,
    unpatch_model,
)

__all__ = [
    "TurboSparkBatchKVCache",
    "TurboSparkKVCache",
    "load_prompt_cache",
    "make_prompt_cache",
    "patch_model",
    "register_cache_classes",
    "save_prompt_cache",
    "unpatch_model",
]
