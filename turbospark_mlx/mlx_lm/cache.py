"""The TurboSpark cache classes mlx-lm holds in its per-layer cache list.

`TurboSparkKVCache` is a thin adapter over a one-layer `KVCacheManager`: converted
attention (`patch.py`) writes through `store_kv` (staging -> `commit_kv` quantizes) and
reads through `attention_any`; the compressed history is never expanded to FP16, so
`update_and_fetch`, which unconverted attention code calls for FP16 K/V, raises a clear
error. `TurboSparkBatchKVCache` serves `mlx_lm.batch_generate` / `BatchGenerator` through
merge / extract / filter / extend, one single-sequence cache per sequence (padding is skipped,
never stored).

Supported mlx-lm: >=0.31.3,<0.33 (0.31.x saves `state` arrays plus `meta_state`
strings; 0.32.x puts scalars and strings in `state`).
"""

from __future__ import annotations

import copy
from typing import Sequence

import mlx.core as mx

from ..attention import attention_any, store_and_attend
from ..cache import KVCacheManager, LayerSpec, store_kv
from ..quant.config import DEFAULT_PRESET, TurboQuantConfig, get_preset

__all__ = ["TurboSparkBatchKVCache", "TurboSparkKVCache"]

_NAMES = ("k_codes", "k_norms", "v_codes", "v_norms")
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


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


class TurboSparkKVCache:
    """mlx-lm prompt cache for one full-attention layer, TurboQuant-compressed.

    An adapter over a one-layer `KVCacheManager`: the manager owns the packed
    codes and norms; this class speaks mlx-lm's cache protocol (offset, state,
    trim, make_mask, merge). Attention reaches it through the converted
    attention modules (`patch_model`), which call `attend`.

    Args:
        kv: a preset name ("tq4", "k8v4", ...) or a `TurboQuantConfig`.
        max_rows: rows quantized per commit (bounds the FP16 staging transient).
        q_block: query rows per attention call during prefill; bounds the score
            matrix of a long chunk ((B, Hq, q_block, T) at a time).
        dtype: dtype of the uncompressed rows and staging, "float16", "bfloat16" or
            "float32"; by default the dtype the model's keys come in.
        max_kv_size: keep the preset's sink rows and the newest max_kv_size - sink_rows
            positions, in flat memory (mlx-lm's `make_prompt_cache(model, max_kv_size)`
            bounds its caches the same way); needs a protected preset whose window
            and sink rows fit inside it. None: every position.

    Attributes:
        config: the per-layer preset (bits per side, rotation, seed).
    """

    step = 256

    def __init__(
        self,
        kv: str | TurboQuantConfig = DEFAULT_PRESET,
        *,
        max_rows: int = 256,
        q_block: int = 256,
        dtype=None,
        max_kv_size: int | None = None,
    ):
        self._setup(kv, max_rows, q_block, dtype, max_kv_size)

    def _setup(
        self, config, max_rows: int, q_block: int, dtype: str | None, max_kv_size: int | None = None
    ) -> None:
        if max_rows < 1 or q_block < 1:
            raise ValueError(f"max_rows and q_block must be >= 1, got {max_rows}, {q_block}")
        self.config = _layer_config(get_preset(config))
        self._config_json = self.config.to_json()  # `state` carries it; built once
        if self.config.is_fp16:
            raise ValueError("a TurboSpark cache needs a compressed preset; fp16 layers use mlx-lm's KVCache")
        if max_kv_size is not None:
            fp16 = self.config.sink_rows + self.config.window_rows
            if not isinstance(max_kv_size, int) or max_kv_size < 1:
                raise ValueError(f"max_kv_size must be an int >= 1, got {max_kv_size!r}")
            if not self.config.is_protected:
                raise ValueError(
                    f"max_kv_size needs a protected preset (window or sink rows): {self.config.name!r} "
                    "compresses every position, so its codes cannot rotate behind sink rows"
                )
            if max_kv_size <= fp16:
                raise ValueError(
                    f"max_kv_size={max_kv_size} leaves nothing to compress: preset {self.config.name!r} keeps "
                    f"{fp16} rows in FP16 (sink_rows + window_rows); use mlx-lm's RotatingKVCache for this bound"
                )
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or None, got {dtype!r}")
        self.max_kv_size = max_kv_size
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
            max_kv_size=self.max_kv_size,
            dtype=_DTYPES[self.dtype_name],
            step=self.step,
        )

    def _ensure(self, keys: mx.array) -> KVCacheManager:
        B, H, _, D = keys.shape
        if self.dtype_name is None:
            # The keys' own dtype, as mlx-lm's KVCache stores them (other floats: float16).
            self.dtype_name = next((n for n, d in _DTYPES.items() if d == keys.dtype), "float16")
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

    def _store_and_attend(self, queries, keys, values, *, scale, sinks) -> mx.array:
        """Write M rows at the next position (quantized through the project's write path) and attend."""
        if keys.shape != values.shape:
            raise ValueError(f"keys {keys.shape} and values {values.shape} differ in shape")
        kv = self._ensure(keys)
        pos = kv.layer_offset(0)
        M = keys.shape[2]
        if M <= min(self.q_block, self.max_rows):  # one write, one query block (a decode step)
            out = store_and_attend(kv, 0, queries, keys, values, pos, scale=scale, sinks=sinks)
            kv.stage.rows.clear()
            return out
        # Query blocks: at most q_block rows, split where a write of max_rows rows ends. Rows
        # are stored piece by piece just ahead of the block that reads them: a layer's FP16
        # window ring holds max_rows rows beyond it.
        cuts = sorted({0, M} | set(range(0, M, self.q_block)) | set(range(0, M, self.max_rows)))
        outs, stored = [], 0
        for a, b in zip(cuts, cuts[1:]):
            while stored < b:
                e = min(M, stored + self.max_rows)
                store_kv(kv, 0, pos + stored, keys[:, :, stored:e], values[:, :, stored:e])
                stored = e
            q = queries[:, :, a:b]
            if outs:
                # Block a+1 waits for block a, so MLX frees a's scores before b's exist
                # (measured: a 2048-row chunk over 8k keys, 623 -> 177 MiB of transients).
                q = mx.depends(q, outs[-1])
            outs.append(attention_any(kv, 0, q, pos + a, scale=scale, sinks=sinks))
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
            self._config_json,
            self.dtype_name or "",
            self.max_rows,
            self.q_block,
            *self.shape,
            "" if self.max_kv_size is None else self.max_kv_size,
        )

    def _set_config_meta(
        self, config_json, dtype_name, max_rows, q_block, n_kv_heads, head_dim, max_kv_size=""
    ) -> None:
        bound = None if max_kv_size in ("", None) else int(max_kv_size)
        config = TurboQuantConfig.from_json(config_json)
        self._setup(config, int(max_rows), int(q_block), dtype_name or None, bound)
        self.shape = (int(n_kv_heads), int(head_dim))

    def _ring_from(self) -> int:
        return 0 if self._kv is None else self._kv.ring_from(0)

    def _restore(self, arrays: Sequence, offset: int, ring_from: int = 0) -> None:
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
        self._kv.set_layer_arrays(0, named, int(offset), int(ring_from))

    @property
    def offset(self) -> int:
        return self._position()

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, sinks=None
    ) -> mx.array:
        """Store M new (post-RoPE) K/V rows and return attention of the M queries over the cache."""
        return self._store_and_attend(queries, keys, values, scale=scale, sinks=sinks)

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
        return (*arrays, self.offset, *self._config_meta(), self._ring_from())

    @state.setter
    def state(self, v):
        v = list(v)
        if len(v) <= 9:  # 0.31: arrays only; meta_state follows (it rebuilds the manager)
            self._pending_arrays = v
            return
        # Arrays, the offset, then the config entries from its JSON on (6, or 7 with
        # max_kv_size) and the ring's oldest held position (states saved without it: 0).
        at = next((i for i, x in enumerate(v) if isinstance(x, str)), None)
        if at is None or at < 1 or len(v) - at not in (6, 7, 8):
            raise ValueError(
                f"TurboSparkKVCache state of {len(v)} entries is not arrays, an offset and its config"
            )
        meta = v[at:]
        ring_from = _pop_ring_from(meta)
        self._set_config_meta(*meta)
        self._restore(v[: at - 1], int(v[at - 1]), int(ring_from))

    @property
    def meta_state(self):
        return tuple(str(x) for x in (self.offset, *self._config_meta(), self._ring_from()))

    @meta_state.setter
    def meta_state(self, v):
        offset, *meta = v
        ring_from = _pop_ring_from(meta)
        self._set_config_meta(*meta)
        pending = getattr(self, "_pending_arrays", [None] * len(self._names()))
        self._restore(pending, int(offset), int(ring_from))
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
        """A batch cache of copies of these sequences, as BatchKVCache.merge."""
        return TurboSparkBatchKVCache.merge(caches)


# Entries of TurboSparkKVCache._config_meta; a state carries the ring's oldest held position after them.
_CONFIG_ENTRIES = 7


def _pop_ring_from(meta: list) -> int:
    """The ring's oldest held position off the end of a state's config entries; states saved
    without it (6 or 7 config entries) give 0."""
    return int(meta.pop()) if len(meta) == _CONFIG_ENTRIES + 1 else 0


class TurboSparkBatchKVCache:
    """Batched TurboSpark cache for `BatchGenerator` / `batch_generate`, the counterpart of
    mlx-lm's `BatchKVCache`: one `TurboSparkKVCache` per sequence.

    Each sequence writes and reads its own single-sequence cache at its own position, so
    padding is never stored: pad rows of a left- or right-padded input are skipped (their
    outputs are zeros, which the caller discards), every preset batches (a protected
    preset's sink rows and key mean stay the sequence's own), and each sequence's results
    are those of running it alone. `offset` is a (B,) array for RoPE. The projections still
    run batched in the model; attention costs one call per sequence.
    """

    def __init__(
        self,
        left_padding: Sequence[int],
        kv=DEFAULT_PRESET,
        *,
        max_rows=256,
        q_block=256,
        dtype=None,
        max_kv_size=None,
    ):
        self.seqs = [
            TurboSparkKVCache(kv, max_rows=max_rows, q_block=q_block, dtype=dtype, max_kv_size=max_kv_size)
            for _ in left_padding
        ]
        self._skip = [int(p) for p in left_padding]  # leading pad rows still to come, per sequence
        self._take: list[int] | None = None  # real rows still to come in a right-padded prompt

    @property
    def offset(self) -> mx.array:
        return mx.array([s.offset for s in self.seqs])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.seqs)

    def empty(self) -> bool:
        return all(s.empty() for s in self.seqs)

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max((s.offset for s in self.seqs), default=0)

    def _rows(self, b: int, M: int) -> tuple[int, int]:
        """Rows [lo, hi) of the next M that are sequence b's tokens (the rest are padding)."""
        lo = min(M, self._skip[b])
        self._skip[b] -= lo
        hi = M
        if self._take is not None:
            hi = min(M, lo + self._take[b])
            self._take[b] -= hi - lo
        return lo, hi

    def attend(self, queries, keys, values, *, scale: float, sinks=None) -> mx.array:
        B, _, M, _ = keys.shape
        if B != len(self.seqs):
            raise ValueError(f"batch of {B} sequences, the cache holds {len(self.seqs)}")
        outs = []
        for b, seq in enumerate(self.seqs):
            lo, hi = self._rows(b, M)
            out = mx.zeros((1, queries.shape[1], M, queries.shape[3]), queries.dtype)
            if hi > lo:
                rows = slice(b, b + 1), slice(None), slice(lo, hi)
                part = seq.attend(queries[rows], keys[rows], values[rows], scale=scale, sinks=sinks)
                out = part if (lo, hi) == (0, M) else mx.concatenate([out[:, :, :lo], part, out[:, :, hi:]], axis=2)
            outs.append(out)
        return mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return None  # converted attention masks each sequence itself

    def update_and_fetch(self, keys, values):
        return self.seqs[0].update_and_fetch(keys, values)  # raises: see TurboSparkKVCache

    def trim(self, n: int) -> int:
        return min([s.trim(n) for s in self.seqs], default=0)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """The next input's padding: left padding rows come first, `lengths` real rows then."""
        if left_padding is not None:
            self._skip = [p + int(q) for p, q in zip(self._skip, left_padding)]
        if lengths is not None and right_padding is not None and max(right_padding) > 0:
            self._take = [int(n) for n in lengths]

    def finalize(self) -> None:
        """The right-padded prompt is in: nothing to move, the padding was never stored."""
        self._take = None

    def filter(self, batch_indices) -> None:
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        self.seqs = [self.seqs[i] for i in keep]
        self._skip = [self._skip[i] for i in keep]
        if self._take is not None:
            self._take = [self._take[i] for i in keep]

    def extend(self, other: "TurboSparkBatchKVCache") -> None:
        self.seqs += other.seqs
        self._skip += other._skip
        if self._take is not None or other._take is not None:
            raise ValueError("cannot extend a TurboSparkBatchKVCache in the middle of a padded prompt")

    def extract(self, idx: int) -> TurboSparkKVCache:
        """Sequence `idx` as a single-sequence cache (a copy: the batch goes on unchanged)."""
        return copy.deepcopy(self.seqs[idx])

    @classmethod
    def merge(cls, caches: Sequence[TurboSparkKVCache]) -> "TurboSparkBatchKVCache":
        """A batch of copies of these caches (they stay as they are, e.g. in a prompt cache)."""
        first = caches[0]
        for c in caches:
            if (c.config, c.max_kv_size) != (first.config, first.max_kv_size):
                raise ValueError("cannot batch TurboSpark caches built with different presets or max_kv_size")
        batch = cls([0] * len(caches), first.config, max_rows=first.max_rows, q_block=first.q_block,
                    dtype=first.dtype_name, max_kv_size=first.max_kv_size)  # fmt: skip
        batch.seqs = [copy.deepcopy(c) for c in caches]
        return batch

    @property
    def state(self):
        """Each sequence's state (what BatchGenerator evaluates and save_prompt_cache stores)."""
        return [s.state for s in self.seqs]

    @state.setter
    def state(self, v):
        self.seqs = [TurboSparkKVCache.from_state(s) for s in v]
        self._skip, self._take = [0] * len(self.seqs), None

    @classmethod
    def from_state(cls, state, meta_state=None):
        if meta_state is not None:
            raise ValueError("a TurboSparkBatchKVCache is saved with mlx-lm >= 0.32; extract() its sequences instead")
        obj = cls.__new__(cls)
        obj.state = state
        return obj
