"""The TurboSpark cache classes mlx-lm holds in its per-layer cache list.

`TurboSparkKVCache` is a thin adapter over a one-layer `KVCacheManager`: converted
attention (`patch.py`) writes through `store_kv` (staging -> `commit_kv` quantizes) and
reads through `attention_any`; the compressed history is never expanded to FP16, so
`update_and_fetch`, which unconverted attention code calls for FP16 K/V, raises a clear
error. `TurboSparkBatchKVCache` serves `mlx_lm.batch_generate` / `BatchGenerator` through
merge / extract / filter / extend, with left padding as a per-sequence `kv_start`.

Supported mlx-lm: >=0.31.3,<0.33 (0.31.x saves `state` arrays plus `meta_state`
strings; 0.32.x puts scalars and strings in `state`).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..attention import attention_any
from ..cache import KVCacheManager, LayerSpec, store_kv
from ..quant.config import DEFAULT_PRESET, TurboQuantConfig, get_preset

__all__ = ["TurboSparkBatchKVCache", "TurboSparkKVCache"]

_NAMES = ("k_codes", "k_norms", "v_codes", "v_norms")
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def _legacy_protocol() -> bool:
    """True on mlx-lm <= 0.31.x, whose caches carry `meta_state` strings beside array-only `state`."""
    from mlx_lm.models import cache

    return "meta_state" in vars(cache._BaseCache)


def _layer_config(config: TurboQuantConfig) -> TurboQuantConfig:
    """The preset for one compressed layer: bits, rotation and seed kept, layer policy dropped.

    The policy was already applied when the model's cache list was built; each
    TurboSpark cache is a one-layer manager whose only layer is compressed. Its
    rotations are therefore those the preset's seed gives layer 0, the same in
    every layer (TurboQuant only needs each rotation random, not distinct).
    """
    return config.with_(name=config.name, fp16_first=0, fp16_last=0, fp16_layers=(), quantize_layers=None)


class _TurboSparkCacheBase:
    """What the single and batch caches share: a one-layer `KVCacheManager` and its protocol glue.

    Attributes:
        config: the per-layer preset (bits per side, rotation, seed).
        max_rows: rows quantized per commit; longer writes (prefill chunks) go
            in pieces of this many rows, which bounds the FP16 staging transient.
        q_block: query rows per attention call; bounds the score matrix of a
            long prefill chunk (scores are (B, Hq, q_block, T) at a time).
    """

    step = 256

    def _setup(self, config: TurboQuantConfig, max_rows: int, q_block: int, dtype: str | None) -> None:
        if max_rows < 1 or q_block < 1:
            raise ValueError(f"max_rows and q_block must be >= 1, got {max_rows}, {q_block}")
        self.config = _layer_config(get_preset(config))
        if self.config.is_fp16:
            raise ValueError("a TurboSpark cache needs a compressed preset; fp16 layers use mlx-lm's KVCache")
        self.max_rows = max_rows
        self.q_block = q_block
        self.dtype_name = dtype
        self.shape = (0, 0)  # (n_kv_heads, head_dim), known from the first write
        self._kv: KVCacheManager | None = None

    def _manager(self, batch_size: int) -> KVCacheManager:
        return KVCacheManager(
            [LayerSpec(*self.shape)],
            self.config,
            batch_size=batch_size,
            max_rows=self.max_rows,
            dtype=_DTYPES[self.dtype_name],
            step=self.step,
        )

    def _ensure(self, keys: mx.array) -> KVCacheManager:
        B, H, _, D = keys.shape
        if self.dtype_name is None:
            # Staging dtype: bfloat16 models stage in bfloat16, the rest (fp16, fp32) in float16.
            self.dtype_name = "bfloat16" if keys.dtype == mx.bfloat16 else "float16"
        if self._kv is None:
            self.shape = (H, D)
            self._kv = self._manager(B)
        else:
            spec = self._kv.specs[0]
            if (self._kv.batch_size, spec.n_kv_heads, spec.head_dim) != (B, H, D):
                raise ValueError(
                    f"{type(self).__name__}: K/V of shape (B, H, D)={(B, H, D)} do not match the cache's "
                    f"{(self._kv.batch_size, spec.n_kv_heads, spec.head_dim)}"
                )
        return self._kv

    def _position(self) -> int:
        return 0 if self._kv is None else self._kv.layer_offset(0)

    def _store_and_attend(self, queries, keys, values, *, scale, sinks, kv_starts) -> mx.array:
        """Write M rows at the next position (quantized through the project's write path) and attend.

        kv_starts: list of (row_from, kv_start) query-block boundaries, see
        `TurboSparkBatchKVCache._kv_starts`; [(0, 0)] for an unpadded cache.
        """
        if keys.shape != values.shape:
            raise ValueError(f"keys {keys.shape} and values {values.shape} differ in shape")
        kv = self._ensure(keys)
        pos = kv.layer_offset(0)
        M = keys.shape[2]
        # Query blocks: at most q_block rows, split where a sequence's kv_start changes and
        # where a write of max_rows rows ends. Rows are stored piece by piece just ahead of
        # the block that reads them: a layer's FP16 window ring holds max_rows rows beyond it.
        cuts = {0, M} | {r for r, _ in kv_starts if 0 < r < M}
        cuts = sorted(cuts | set(range(0, M, self.q_block)) | set(range(0, M, self.max_rows)))
        outs, stored = [], 0
        for a, b in zip(cuts, cuts[1:]):
            while stored < b:
                e = min(M, stored + self.max_rows)
                store_kv(kv, 0, pos + stored, keys[:, :, stored:e], values[:, :, stored:e])
                stored = e
            start = next(st for r, st in reversed(kv_starts) if r <= a)
            q = queries[:, :, a:b]
            if outs:
                # Block a+1 waits for block a, so MLX frees a's scores before b's exist
                # (measured: a 2048-row chunk over 8k keys, 623 -> 177 MiB of transients).
                q = mx.depends(q, outs[-1])
            outs.append(attention_any(kv, 0, q, pos + a, scale=scale, sinks=sinks, kv_start=start))
        # Staging rows are a transient of the write: none are kept between calls.
        kv.stage.rows.clear()
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def update_and_fetch(self, keys, values):
        raise RuntimeError(
            f"{type(self).__name__} holds TurboQuant-compressed K/V and never hands out an FP16 copy of the "
            "history; this attention module was not converted. Build the cache with "
            "turbospark_mlx.mlx_lm.make_prompt_cache(model, ...) (it converts the model's supported "
            "attention modules), or keep mlx-lm's KVCache for this model."
        )

    # -- protocol pieces every mlx-lm cache has --------------------------------

    def _names(self) -> tuple[str, ...]:
        """The storage arrays a state carries: codes and norms, then a protected layer's FP16
        window ring, sink rows and key mean."""
        extra = ("k_recent", "v_recent", "k_sinks", "v_sinks") if self.config.is_protected else ()
        return _NAMES + extra + (("k_mean",) if self.config.center_keys else ())

    def _arrays(self) -> dict[str, mx.array]:
        return {} if self._kv is None else self._kv.layer_arrays(0)

    @property
    def nbytes(self) -> int:
        return 0 if self._kv is None else self._kv.nbytes

    def empty(self) -> bool:
        return self._kv is None or not self._kv.layer_arrays(0)

    def is_trimmable(self) -> bool:
        return True

    def _config_meta(self) -> tuple:
        return (
            self.config.to_json(),
            self.dtype_name or "",
            self.max_rows,
            self.q_block,
            *self.shape,
        )

    def _set_config_meta(self, config_json, dtype_name, max_rows, q_block, n_kv_heads, head_dim) -> None:
        self._setup(TurboQuantConfig.from_json(config_json), int(max_rows), int(q_block), dtype_name or None)
        self.shape = (int(n_kv_heads), int(head_dim))

    def _restore(self, arrays: Sequence, offset: int) -> None:
        """Rebuild the manager from stored arrays (None or empty when nothing was written)."""
        if len(arrays) != len(self._names()):
            raise ValueError(f"{type(self).__name__}: state has {len(arrays)} arrays, expected {len(self._names())}")
        # A protected layer holds no codes until a row leaves its window: those entries are None.
        named = {n: a for n, a in zip(self._names(), arrays) if a is not None and a.size > 0}
        if not named:
            if offset:
                raise ValueError(f"{type(self).__name__}: state has offset {offset} but no storage arrays")
            return
        self._kv = self._manager(next(iter(named.values())).shape[0])
        self._kv.set_layer_arrays(0, named, int(offset))


class TurboSparkKVCache(_TurboSparkCacheBase):
    """mlx-lm prompt cache for one full-attention layer, TurboQuant-compressed.

    An adapter over a one-layer `KVCacheManager`: the manager owns the packed
    codes and norms; this class speaks mlx-lm's cache protocol (offset, state,
    trim, make_mask, merge). Attention reaches it through the converted
    attention modules (`patch_model`), which call `attend`.

    Args:
        kv: a preset name ("tq4", "k8v4", ...) or a `TurboQuantConfig`.
        max_rows: rows quantized per commit (bounds the FP16 staging transient).
        q_block: query rows per attention call during prefill.
        dtype: staging dtype, "float16" or "bfloat16"; by default bfloat16 for
            bfloat16 models, float16 otherwise.
    """

    def __init__(
        self, kv: str | TurboQuantConfig = DEFAULT_PRESET, *, max_rows: int = 256, q_block: int = 256, dtype=None
    ):
        self._setup(kv, max_rows, q_block, dtype)

    @property
    def offset(self) -> int:
        return self._position()

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, sinks=None
    ) -> mx.array:
        """Store M new (post-RoPE) K/V rows and return attention of the M queries over the cache."""
        return self._store_and_attend(queries, keys, values, scale=scale, sinks=sinks, kv_starts=[(0, 0)])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, int(n))
        if n > 0:
            self._kv.trim(n)
        return n

    # -- state: 0.32 puts everything in `state`; 0.31 splits arrays / meta_state --

    @property
    def state(self):
        arrays = tuple(self._arrays().get(n) for n in self._names())
        if _legacy_protocol():
            return arrays
        return (*arrays, self.offset, *self._config_meta())

    @state.setter
    def state(self, v):
        v = list(v)
        if len(v) <= 9:  # 0.31: arrays only; meta_state follows (it rebuilds the manager)
            self._pending_arrays = v
            return
        if len(v) < 11:
            raise ValueError(f"TurboSparkKVCache state has {len(v)} entries, expected 11 or more")
        self._set_config_meta(*v[-6:])  # arrays, offset, then the six config entries
        self._restore(v[:-7], int(v[-7]))

    @property
    def meta_state(self):
        return tuple(str(x) for x in (self.offset, *self._config_meta()))

    @meta_state.setter
    def meta_state(self, v):
        offset, *meta = v
        self._set_config_meta(*meta)
        self._restore(getattr(self, "_pending_arrays", [None] * len(self._names())), int(offset))
        self.__dict__.pop("_pending_arrays", None)

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    # -- batching -----------------------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence["TurboSparkKVCache"]) -> "TurboSparkBatchKVCache":
        """A batch cache holding these sequences right-justified (left padding), as BatchKVCache.merge."""
        return TurboSparkBatchKVCache.merge(caches)


class TurboSparkBatchKVCache(_TurboSparkCacheBase):
    """Batched TurboSpark cache for `BatchGenerator`, the counterpart of mlx-lm's `BatchKVCache`.

    Sequences are left-padded: sequence b's rows before `left_padding[b]` are
    padding and are hidden from attention by `kv_start = left_padding`.
    `offset` is a (B,) array (tokens per sequence, for RoPE); `_idx` the next
    storage row.
    """

    def __init__(self, left_padding: Sequence[int], kv=DEFAULT_PRESET, *, max_rows=256, q_block=256, dtype=None):
        self._setup(kv, max_rows, q_block, dtype)
        if self.config.is_protected:
            raise NotImplementedError(
                f"preset {self.config.name!r} keeps FP16 window / sink rows, which batched generation "
                f"does not merge yet; for BatchGenerator pass get_preset({self.config.name!r}).plain() "
                "(window_rows=0, sink_rows=0, center_keys=False)"
            )
        self._pad = [int(p) for p in left_padding]
        self.offset = mx.array([-p for p in self._pad])
        self._idx = 0
        self._right_padding = None

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._pad)

    def _kv_starts(self, M: int) -> list[tuple[int, int | mx.array]]:
        """Query-block boundaries and kv_start per block for M rows at `_idx`.

        A query row at position t of sequence b is a padding row when t < pad[b];
        `attention_any` needs kv_start <= the block's first position, so blocks
        are cut at each padding boundary and a padding row's kv_start is clamped
        to its block start (its output is discarded by the model's caller).
        """
        pos = self._idx
        cuts = sorted({p - pos for p in self._pad if pos < p < pos + M} | {0})
        if max(self._pad) == 0:
            return [(0, 0)]
        return [(r, mx.array([min(p, pos + r) for p in self._pad])) for r in cuts]

    def attend(self, queries, keys, values, *, scale: float, sinks=None) -> mx.array:
        if keys.shape[0] != len(self._pad):
            raise ValueError(f"batch of {keys.shape[0]} sequences, the cache holds {len(self._pad)}")
        out = self._store_and_attend(
            queries, keys, values, scale=scale, sinks=sinks, kv_starts=self._kv_starts(keys.shape[2])
        )
        self._idx += keys.shape[2]
        self.offset = self.offset + keys.shape[2]
        return out

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        from mlx_lm.models.base import create_causal_mask

        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def trim(self, n: int) -> int:
        n = min(self._idx, int(n))
        if n > 0:
            self._kv.trim(n)
            self._idx -= n
            self.offset = self.offset - n
        return n

    def _set_arrays(self, arrays: dict[str, mx.array], idx: int) -> None:
        """Replace storage (any batch size) and the next row index."""
        if not arrays:
            self._kv = None
        else:
            self._kv = self._manager(arrays["k_codes"].shape[0])
            self._kv.set_layer_arrays(0, arrays, idx)
        self._idx = idx

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self._kv is not None:
                raise ValueError("left padding can only be added to an empty TurboSparkBatchKVCache")
            self._pad = [p + int(q) for p, q in zip(self._pad, left_padding)]
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = [int(p) for p in right_padding]

    def finalize(self) -> None:
        """Right padding (prompts processed together) becomes left padding: roll each row right."""
        if self._right_padding is None:
            return
        from mlx_lm.models.cache import dynamic_roll

        shifts = mx.array(self._right_padding)
        if self._kv is not None:
            arrays = {n: dynamic_roll(a, shifts[:, None], axis=2) for n, a in self._arrays().items()}
            self._set_arrays(arrays, self._idx)
        self.offset = self.offset - shifts
        self._pad = [p + r for p, r in zip(self._pad, self._right_padding)]
        self._right_padding = None

    def filter(self, batch_indices) -> None:
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        keep = [int(i) for i in idx.tolist()]
        arrays = {n: a[idx] for n, a in self._arrays().items()}
        self.offset = self.offset[idx]
        self._pad = [self._pad[i] for i in keep]
        shift = min(self._pad) if self._pad else 0
        if shift > 0:  # drop the columns every sequence pads
            arrays = {n: a[:, :, shift:] for n, a in arrays.items()}
            self._pad = [p - shift for p in self._pad]
        self._set_arrays(arrays, self._idx - shift)

    def extend(self, other: "TurboSparkBatchKVCache") -> None:
        if self.empty() and other.empty():
            self._pad += other._pad
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        ref = (self if not self.empty() else other)._arrays()
        cap = max(a["k_codes"].shape[2] for a in (self._arrays(), other._arrays()) if a)

        def pad(c):
            arrays = c._arrays()
            B = len(c._pad)
            if not arrays:
                arrays = {n: mx.zeros((B, *r.shape[1:2], 0, *r.shape[3:]), r.dtype) for n, r in ref.items()}
            left = max_idx - c._idx
            right = cap - arrays["k_codes"].shape[2] - left
            out = {}
            for n, a in arrays.items():
                if right < 0:
                    a = a[:, :, :right]
                widths = [(0, 0), (0, 0), (left, max(right, 0))] + [(0, 0)] * (a.ndim - 3)
                out[n] = mx.pad(a, widths) if left or right > 0 else a
            return out, [p + left for p in c._pad]

        (a1, p1), (a2, p2) = pad(self), pad(other)
        self.offset = mx.concatenate([self.offset, other.offset])
        self._pad = p1 + p2
        self._set_arrays({n: mx.concatenate([a1[n], a2[n]]) for n in a1}, max_idx)

    def extract(self, idx: int) -> TurboSparkKVCache:
        """Sequence `idx` as a single-sequence cache (its padding dropped)."""
        single = TurboSparkKVCache(
            self.config, max_rows=self.max_rows, q_block=self.q_block, dtype=self.dtype_name
        )
        p = self._pad[idx]
        arrays = {n: mx.contiguous(a[idx : idx + 1, :, p : self._idx]) for n, a in self._arrays().items()}
        single.shape = self.shape
        if arrays:
            single._kv = single._manager(1)
            single._kv.set_layer_arrays(0, arrays, self._idx - p)
        return single

    @classmethod
    def merge(cls, caches: Sequence[TurboSparkKVCache]) -> "TurboSparkBatchKVCache":
        first = next((c for c in caches if c.size()), caches[0])
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        batch = cls(
            [max_length - n for n in lengths],
            first.config,
            max_rows=first.max_rows,
            q_block=first.q_block,
            dtype=first.dtype_name,
        )
        if max_length == 0:
            return batch
        for c in caches:
            if c.config != first.config:
                raise ValueError("cannot batch TurboSpark caches built with different presets")
        ref = next(c._arrays() for c in caches if c.size())
        rows = {}
        for n, r in ref.items():
            parts = []
            for pad_rows, c in zip(batch._pad, caches):
                a = c._arrays().get(n)
                a = (
                    a[:, :, : c.size()]
                    if a is not None
                    else mx.zeros((1, r.shape[1], 0, *r.shape[3:]), r.dtype)
                )
                parts.append(mx.pad(a, [(0, 0), (0, 0), (pad_rows, 0)] + [(0, 0)] * (a.ndim - 3)))
            rows[n] = mx.concatenate(parts)
        batch.shape = first.shape
        batch._set_arrays(rows, max_length)
        batch.offset = batch.offset + max_length
        return batch

    @property
    def state(self):
        arrays = tuple(self._arrays().get(n) for n in _NAMES)
        return (*arrays, self.offset, mx.array(self._pad), self._idx, *self._config_meta())

    @state.setter
    def state(self, v):
        v = list(v)
        self._set_config_meta(*v[7:])
        self._pad = [int(p) for p in v[5].tolist()]
        self.offset = v[4]
        self._right_padding = None
        arrays = v[:4]
        if any(a is None or a.size == 0 for a in arrays):
            self._set_arrays({}, int(v[6]))
        else:
            self._set_arrays(dict(zip(_NAMES, arrays)), int(v[6]))

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj.state = state
        return obj
