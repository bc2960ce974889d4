"""Hugging Face model directories and repo ids: mlx-lm's loader (safetensors, sharded,
mlx-community quantized weights) with this package's family classes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..models import get_model_classes

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
        cast_floats(model, dtype)
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


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast float parameters (not packed weights, which are uint32) to dtype."""
    model.update(
        nn.utils.tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()
        )
    )


def snapshot(repo_id: str, revision: str | None) -> Path:
    """Download (or find in the local HF cache) the files a model needs."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HF_ALLOW_PATTERNS))
    except Exception as e:  # offline without a cached copy, unknown repo, no network, ...
        raise FileNotFoundError(
            f"could not get {repo_id!r} from the Hugging Face Hub or its local cache: {type(e).__name__}: {e}"
        ) from e
