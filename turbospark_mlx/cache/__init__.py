"""The KV cache: `KVCacheManager` and the write path (`manager.py`), cache files (`io.py`)."""

from .spec import LayerSpec
from .manager import (
    KVCacheManager,
    KVStage,
    KVTarget,
    commit_kv,
    kv_write_target,
    make_cache,
    model_dtype,
    store_kv,
)

__all__ = [
    "KVCacheManager",
    "KVStage",
    "KVTarget",
    "LayerSpec",
    "commit_kv",
    "kv_write_target",
    "make_cache",
    "model_dtype",
    "store_kv",
]
