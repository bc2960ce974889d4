"""turbospark-mlx: MLX model execution with a TurboQuant-compressed KV cache."""

from .attention import attention_any
from .cache import (
    KvCacheManager,
    KvStage,
    KvTarget,
    LayerSpec,
    commit_kv,
    kv_write_target,
    make_cache,
    store_kv,
)
from .quant import PRESETS, LayerQuant, SideQuant, TurboQuantConfig, get_preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "KvCacheManager",
    "KvStage",
    "KvTarget",
    "LayerQuant",
    "LayerSpec",
    "SideQuant",
    "TurboQuantConfig",
    "attention_any",
    "commit_kv",
    "get_preset",
    "kv_write_target",
    "make_cache",
    "store_kv",
]
