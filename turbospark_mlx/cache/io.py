"""Cache files: a KV cache manager's's storage and layout in one safetensors file.

The metadata carries the preset (`TurboQuantConfig.to_json`), the layer specs, the
offsets and capacities, and a fingerprint of every compressed layer's tables; a SHA-256
digest over tensors and metadata makes a truncated or edited file fail to load. Saves are
atomic: a temporary file beside the target is written, flushed to disk and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict

import mlx.core as mx
import numpy as np

from ..quant.config import TurboQuantConfig
from ..quant.tables import SIDES
from . import window
from .spec import LayerSpec

FILE_FORMAT = "turbospark-kv/1"
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _meta(cache) -> dict[str, str]:
    fingerprints = {
        str(i): {h: q.side(h).fingerprint() for h in SIDES} for i, q in cache.quant_tables().items()
    }
    layers = cache.owned_layers()
    return {
        "format": FILE_FORMAT,
        "config": cache.config.to_json(),
        "layers": json.dumps([None if s is None else asdict(s) for s in cache.specs]),
        "batch_size": str(cache.batch_size),
        "max_rows": str(cache.max_rows),
        "max_context": json.dumps(cache.max_context),
        "max_kv_size": json.dumps(cache.max_kv_size),
        "dtype": _dtype_name(cache.dtype),
        "step": str(cache.step),
        "offsets": json.dumps({str(i): l.offset for i, l in layers.items()}),
        "capacities": json.dumps({str(i): l.capacity for i, l in layers.items()}),
        "ring_from": json.dumps({str(i): l.recent_from for i, l in layers.items() if l.recent_capacity}),
        "fingerprints": json.dumps(fingerprints),
    }


def _tensors(cache) -> dict[str, mx.array]:
    return {f"layer.{i}.{name}": a for i, l in cache.owned_layers().items() for name, a in l.arrays.items()}


def digest(tensors: dict[str, mx.array], meta: dict[str, str]) -> str:
    """SHA-256 over the metadata (sorted JSON) and every tensor's name, shape, dtype and bytes."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}:{a.shape}:{a.dtype}".encode())
        h.update(np.asarray(a.reshape(-1).view(mx.uint8)).tobytes())
    return h.hexdigest()


def atomic_save_safetensors(path: str, tensors: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """`mx.save_safetensors` to a temporary file in the target's folder, fsync, rename: an
    interrupted save leaves the file at `path` as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, tensors, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


USER_PREFIX = "user."  # metadata keys a caller adds (covered by the digest like the rest)


def save(cache, path: str, metadata: dict[str, str] | None = None) -> str:
    """See `KVCacheManager.save`."""
    if cache.stage.pending:
        raise ValueError("cannot save with rows written but not committed")
    if not path.endswith(".safetensors"):
        path += ".safetensors"
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("cache file metadata must map strings to strings")
    tensors = _tensors(cache)
    meta = _meta(cache)
    meta.update({USER_PREFIX + k: v for k, v in (metadata or {}).items()})
    meta["digest"] = digest(tensors, meta)
    atomic_save_safetensors(path, tensors, meta)
    return path


def load(path: str, cls: type, return_metadata: bool = False):
    """See `KVCacheManager.from_file`; `cls` is the manager class to build."""
    try:
        tensors, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # safetensors reports truncation in several ways
        raise ValueError(f"cannot read KV cache file {path!r}: {e}") from None
    if meta.get("format") != FILE_FORMAT:
        raise ValueError(f"{path!r} is not a {FILE_FORMAT} KV cache file (format={meta.get('format')!r})")
    stored_digest = meta.pop("digest", None)
    if stored_digest != digest(tensors, meta):
        raise ValueError(f"KV cache file {path!r} is corrupted: its digest does not match its contents")
    try:
        cache = cls(
            [None if s is None else LayerSpec(**s) for s in json.loads(meta["layers"])],
            TurboQuantConfig.from_json(meta["config"]),
            batch_size=int(meta["batch_size"]),
            max_rows=int(meta["max_rows"]),
            max_context=json.loads(meta["max_context"]),
            max_kv_size=json.loads(meta.get("max_kv_size", "null")),
            dtype=FLOAT_DTYPES[meta["dtype"]],
            step=int(meta["step"]),
        )
        offsets = {int(k): v for k, v in json.loads(meta["offsets"]).items()}
        capacities = {int(k): v for k, v in json.loads(meta["capacities"]).items()}
        ring_from = {int(k): int(v) for k, v in json.loads(meta.get("ring_from", "{}")).items()}
        fingerprints = json.loads(meta["fingerprints"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"KV cache file {path!r} has invalid metadata: {e}") from None
    if _meta(cache)["fingerprints"] != json.dumps(fingerprints):
        raise ValueError(f"KV cache file {path!r} was written with different quant tables than this version builds")
    for i, l in cache.owned_layers().items():
        cap, off = capacities.get(i), offsets.get(i)
        ring = l.ring_capacity
        need = None if off is None else min(off, ring or off)
        if l.recent_capacity and off is not None:  # codes only for rows that left the window
            need = min(cache.quantized_end(i, off) - cache.config.sink_rows, ring or off)
        if cap is None or off is None or off < 0 or cap < need or cap > (ring or cap):
            raise ValueError(f"KV cache file {path!r}: bad offset/capacity for layer {i}")
        layout = cache.storage_layout(i) if cap else {}
        for name, (tail, dtype) in layout.items():
            a = tensors.get(f"layer.{i}.{name}")
            want = (cache.batch_size, l.spec.n_kv_heads, cap, *tail)
            if a is None or a.shape != want or a.dtype != dtype:
                got = None if a is None else (a.shape, a.dtype)
                raise ValueError(f"KV cache file {path!r}: layer {i} {name} is {got}, expected {(want, dtype)}")
            l.arrays[name] = a
        for name, (shape, dtype) in cache.fixed_layout(i).items():
            a = tensors.get(f"layer.{i}.{name}")
            if a is None:
                raise ValueError(f"KV cache file {path!r}: layer {i} has no {name}")
            try:
                window.check_fixed(i, name, a, shape, dtype)
            except ValueError as e:
                raise ValueError(f"KV cache file {path!r}: {e}") from None
            l.arrays[name] = a
        l.capacity, l.offset = cap, off
        if l.recent_capacity:
            held = ring_from.get(i, 0)
            if not 0 <= held <= off:
                raise ValueError(
                    f"KV cache file {path!r}: layer {i} ring_from {held} outside [0, offset {off}]"
                )
            try:
                window.check_ring(cache, i, l, l.arrays["k_recent"].shape[2], off)
            except ValueError as e:
                raise ValueError(f"KV cache file {path!r}: {e}") from None
            window.adopt(l, held)
    if set(tensors) != set(_tensors(cache)):
        raise ValueError(f"KV cache file {path!r} holds unexpected tensors")
    if return_metadata:
        return cache, {k[len(USER_PREFIX) :]: v for k, v in meta.items() if k.startswith(USER_PREFIX)}
    return cache
