"""turbospark-mlx: MLX model execution with a TurboQuant-compressed KV cache."""

# Before anything calls a matmul: MLX's CPU backend then runs on MKL (cpu_blas.py says why).
from .cpu_blas import cpu_blas, load_fast_blas

load_fast_blas()

from .attention import attention_any, store_and_attend  # noqa: E402
from . import cpu_ext  # noqa: E402
from .cache import (  # noqa: E402
    KVCacheManager,
    KVStage,
    KVTarget,
    LayerSpec,
    commit_kv,
    kv_write_target,
    make_cache,
    store_kv,
)
from .generate import GenerationResponse, generate, stream_generate  # noqa: E402
from .loading import load  # noqa: E402
from .quant import PRESETS, LayerQuant, SideQuant, TurboQuantConfig, get_preset  # noqa: E402

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
    "cpu_blas",
    "cpu_ext",
    "GenerationResponse",
    "generate",
    "load",
    "stream_generate",
    "get_preset",
    "kv_write_target",
    "make_cache",
    "store_and_attend",
    "store_kv",
]
