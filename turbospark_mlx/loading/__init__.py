"""Load a model and its tokenizer: a local HF directory, an HF repo id, or a GGUF file
(`hf.py`, `gguf.py`; GGUF tokenizers in `tokenizers.py`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cpu import cpu_fast_paths, packed_weight_paths, packed_weights_supported
from .gguf import GGUF_ARCHITECTURES, load_gguf, load_gguf_model, read_gguf
from .hf import load_hf_dir, snapshot

__all__ = [
    "GGUF_ARCHITECTURES",
    "packed_weight_paths",
    "packed_weights_supported",
    "column_major_weights",
    "cpu_fast_paths",
    "load",
    "load_gguf",
    "load_gguf_model",
    "load_hf_dir",
    "read_gguf",
]


def load(
    path_or_repo: str | os.PathLike,
    *,
    revision: str | None = None,
    dtype: mx.Dtype | None = None,
    lazy: bool = False,
    dequantize: bool | None = None,
    group: mx.distributed.Group | None = None,
    pipeline: bool = False,
    progress: Callable[[int, int], None] | None = None,
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
        dequantize: unpack quantized weights (GGUF Q4/Q8, mlx-community checkpoints) into
            dense float weights. Default: on the CPU, where the packed-weight kernels of
            `cpu_ext` do not take them (`cpu_ext.status()` says why; nor do they take a model
            split by heads over a `group`) and they take at most a quarter of the machine's
            memory as float32: MLX's own CPU quantized matmul reads packed weights slower than
            MKL reads float32 ones (benchmarks/results/cpu_speed.md).
        group: split the model over this `mx.distributed` group before any weight is read:
            tensor parallel (`model.shard(group)`: 1/N of every layer's heads and MLP
            columns), or with `pipeline=True` pipeline parallel (`model.pipeline(group)`:
            this rank's run of layers; the other layers' tensors are never read from an HF
            checkpoint). Every rank calls `load` with the same arguments.
        pipeline: with `group`, split by layers instead of by heads.
        progress: called as progress(bytes read, total bytes) while the weights are read
            (not with lazy): after each group of tensors that reaches 2.5% of the bytes
            (a larger tensor is a group of its own).
    Returns:
        (model, tokenizer): a family `Model` and an mlx-lm `TokenizerWrapper`. On the CPU its
        RoPE and RMSNorm modules take the CPU paths of `loading/cpu.py` (`cpu_fast_paths`),
        and packed weights kept packed the products of `cpu_ext` (`packed_weight_paths`).
    Raises:
        FileNotFoundError: a path, config, weight file or shard is missing.
        ValueError: unsupported model type or GGUF architecture, or an unreadable file; a
            family that cannot be split, or heads that do not divide by the group size.
    """
    if pipeline and group is None:
        raise ValueError("pipeline=True needs a group to split the layers over")
    path = Path(path_or_repo).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        model, tokenizer = _named(load_gguf, path, dtype)
    elif path.is_dir():
        model, tokenizer = _named(load_hf_dir, path, dtype)
    elif _looks_like_repo_id(str(path_or_repo)):
        model, tokenizer = _named(load_hf_dir, snapshot(str(path_or_repo), revision), dtype)
    else:
        raise FileNotFoundError(
            f"{str(path_or_repo)!r} is neither a file, a directory, nor a Hugging Face repo id (org/name)"
        )
    on_cpu = mx.default_device() == mx.cpu
    # Split by heads (`shard`), layers become mlx-lm's sharded kinds, which the kernels do not take.
    sharded = group is not None and not pipeline
    packed = on_cpu and dequantize is not True and not sharded and packed_weights_supported(model)
    if dequantize is None:
        dequantize = on_cpu and not packed and 4 * _dense_parameters(model) <= _memory_bytes() // 4
    if dequantize:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    if group is not None:  # the weights are still unread: each rank reads only what it keeps
        if pipeline:
            model.pipeline(group)
        else:
            model.shard(group)
    if not lazy:
        _read_weights(model, progress)
        if on_cpu:
            column_major_weights(model)
    if on_cpu:
        if packed:
            packed_weight_paths(model)
            if not lazy:  # evaluated here: a thread that runs the model (the server's) has other streams
                mx.eval(model.parameters())
        cpu_fast_paths(model)
    return model, tokenizer


def _read_weights(model: nn.Module, progress: Callable[[int, int], None] | None) -> None:
    """Evaluate the parameters; with `progress`, in groups of about 1/40 of their bytes."""
    params = [p for _, p in tree_flatten(model.parameters())]
    if progress is None:
        mx.eval(params)
        return
    total = sum(p.nbytes for p in params)
    done, group, size = 0, [], 0
    progress(0, total)
    for i, p in enumerate(params):
        group.append(p)
        size += p.nbytes
        if size * 40 >= total or i == len(params) - 1:
            mx.eval(group)
            done += size
            group, size = [], 0
            progress(done, total)


def column_major_weights(model: nn.Module) -> None:
    """Keep each float32 Linear / Embedding weight (out, in) with more outputs than inputs as
    the transpose view of an (in, out) array, so `x @ w.T` reaches BLAS untransposed.

    MKL's one-row product (a decode step) reads such a matrix in that layout faster, and a
    matrix with fewer outputs than inputs in the stored one (measured on an x86-64 VM: a
    49152 x 576 output projection 7.8 -> 4.2 ms, 1536 x 576 0.26 -> 0.19 ms, 576 x 1536
    0.21 -> 0.28 ms; docs/backends.md). One weight at a time, so the copy costs one matrix
    of memory at most.
    """
    for _, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.dtype == mx.float32:
            out_features, in_features = module.weight.shape
            if out_features > in_features:
                module.weight = mx.contiguous(module.weight.T).T
                mx.eval(module.weight)


def _named(loader, path: Path, dtype: mx.Dtype | None):
    """`loader(path)`, unevaluated, its ValueErrors naming `path` (mlx-lm's and MLX's do not)."""
    try:
        return loader(path, dtype=dtype, lazy=True)
    except ValueError as e:
        if path.name in str(e):
            raise
        raise ValueError(f"{path}: {e}") from None


def _dense_parameters(model: nn.Module) -> int:
    """Parameters of the model once quantized weights are unpacked."""
    total = 0
    for name, module in model.named_modules():
        if hasattr(module, "scales") and hasattr(module, "bits"):
            total += module.weight.size * 32 // module.bits
    for name, p in tree_flatten(model.parameters()):
        if not name.endswith((".scales", ".biases")) and mx.issubdtype(p.dtype, mx.floating):
            total += p.size
    return total


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _looks_like_repo_id(s: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not s.startswith((".", "/"))
