"""turbospark-mlx: MLX model execution with a TurboQuant-compressed KV cache."""

from .attention import attention_any
from .cache import (
    KVCacheManager,
    KVStage,
    KVTarget,
    LayerSpec,
    commit_kv,
    kv_write_target,
    make_cache,
    store_kv,
)
from .generate import GenerationResponse, generate, stream_generate
from .loading import load
from .quant import PRESETS, LayerQuant, SideQuant, TurboQuantConfig, get_preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "KVCacheManager",
    "KVStage",
    "KVTarget",
    "LayerQuant",
    "LayerSpec",
    "SideQuant",
    "TurboQuantConfig",
    "attention_any",
    "commit_kv",
    "GenerationResponse",
    "generate",
    "load",
    "stream_generate",
    "get_preset",
    "kv_write_target",
    "make_cache",
    "store_kv",
]
