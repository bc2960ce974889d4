"""A fast BLAS under MLX's CPU backend on Linux.

MLX's Linux CPU wheel links the reference BLAS and LAPACK (netlib): a float32 GEMM runs at
~4 GFLOP/s on a 2-core x86-64 VM where an optimized BLAS does 100-200
(`benchmarks/results/cpu_speed.md`). MLX calls `cblas_sgemm` and LAPACK by name, and Python
binds an extension's symbols when it loads it (RTLD_NOW): a library loaded with RTLD_GLOBAL
before `mlx.core` is imported takes those names. So this package, imported first, loads
Intel MKL's single runtime library (`libmkl_rt`, from the `mkl` wheel that the `cpu` extra
installs on Linux x86-64) that way, with OpenMP threads from the system's GNU runtime
(libgomp) where there is one, else MKL's sequential layer. Imported after `mlx.core`, it
cannot, and says so in a warning.

MLX's float16 / bfloat16 matmuls and its quantized matmul do not go through BLAS; the loader
keeps CPU models in float32 (`loading`). Set TURBOSPARK_CPU_BLAS=reference to leave MLX's
own BLAS in place; `cpu_blas()` says which is in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from importlib import metadata
from pathlib import Path

_LOADED: list[str] = []  # the path of the library loaded, once loaded


def _mkl_runtime() -> Path | None:
    """libmkl_rt from the installed `mkl` wheel (its files go to the environment's lib/)."""
    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    return None


def load_fast_blas() -> str | None:
    """Load MKL for MLX's CPU BLAS calls (see the module text); the library's path, or None
    where there is none to load (not Linux x86-64, no `mkl` wheel, or turned off)."""
    if _LOADED:
        return _LOADED[0]
    if os.environ.get("TURBOSPARK_CPU_BLAS", "").lower() == "reference" or not sys.platform.startswith("linux"):
        return None
    path = _mkl_runtime()
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx.core was imported before turbospark_mlx, so MLX's CPU matmuls stay on its reference "
            "BLAS (~50x slower than MKL here); import turbospark_mlx first",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    # MKL's default threading layer needs Intel's OpenMP runtime loaded first; GNU's is there
    # on most Linux systems. A layer the user chose is kept.
    os.environ.setdefault("MKL_THREADING_LAYER", "GNU" if ctypes.util.find_library("gomp") else "SEQUENTIAL")
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise RuntimeError(
            f"turbospark_mlx: {path} (Intel MKL, for MLX's CPU matmuls) failed to load: {e}; "
            "set TURBOSPARK_CPU_BLAS=reference to run on MLX's own BLAS"
        ) from e
    _LOADED.append(str(path))
    return _LOADED[0]


def cpu_blas() -> str:
    """Which BLAS MLX's CPU backend calls: the MKL library's path, or "reference"."""
    return _LOADED[0] if _LOADED else "reference"
