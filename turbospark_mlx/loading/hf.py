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
    for shard in sorted(path.glob("*.safetensors")):
        check_safetensors(shard)


# safetensors dtype names -> bytes per element
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def check_safetensors(path: Path) -> None:
    """A safetensors file's header (8-byte length, JSON table) checked against its size before
    MLX reads it: a damaged or truncated file is a ValueError naming it, not an MLX error."""
    size = path.stat().st_size

    def bad(what: str) -> ValueError:
        return ValueError(f"cannot read safetensors file {path}: {what}; the file is truncated or damaged")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise bad(f"the header claims {n} bytes, the file has {size - 8} after its length")
        try:
            table = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(table, dict):
        raise bad("the header is not a JSON object")
    data = size - 8 - n
    for name, t in table.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in t["data_offsets"])
            count = 1
            for d in t["shape"]:
                count *= int(d)
            width = _ST_BYTES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed entry {t!r}") from None
        if not 0 <= start <= end <= data or end - start != count * width:
            raise bad(f"tensor {name!r} ({t['dtype']} {t['shape']}, bytes {start}..{end}) does not fit the data")


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
