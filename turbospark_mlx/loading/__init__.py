"""Load a model and its tokenizer: a local HF directory, an HF repo id, or a GGUF file
(`hf.py`, `gguf.py`; GGUF tokenizers in `tokenizers.py`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .gguf import GGUF_ARCHITECTURES, load_gguf, load_gguf_model, read_gguf
from .hf import load_hf_dir, snapshot

__all__ = ["GGUF_ARCHITECTURES", "load", "load_gguf", "load_gguf_model", "load_hf_dir", "read_gguf"]


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
        return load_hf_dir(snapshot(str(path_or_repo), revision), dtype=dtype, lazy=lazy)
    raise FileNotFoundError(
        f"{str(path_or_repo)!r} is neither a file, a directory, nor a Hugging Face repo id (org/name)"
    )


def _looks_like_repo_id(s: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not s.startswith((".", "/"))
