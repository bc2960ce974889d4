"""The KV cache manager and the write path.

Write path:
  1. `kv_write_target(kv, side, layer, position)` is where a block puts its
     finished K or V rows (after k-norm / RoPE): the cache slot on an FP16
     layer, the FP16 ring of a protected TurboQuant layer (its slots beyond the
     window hold only rows that have codes), an FP16 staging row (`KVStage`) on
     a plain TurboQuant layer. A
     compressed row is never a write target. A sliding-window ring stages
     too: writing its slot would drop the oldest row it keeps before the
     write is committed, so a side-done write could not be taken back.
  2. `commit_kv(kv, layer, position, m)` makes the M rows part of the cache:
     on a TurboQuant layer it quantizes the K and V staging rows into packed
     codes + norms; on a ring it copies them into the ring; on a growing FP16
     layer no data moves.
  3. `attention.attention_any` then reads the cache, packed or FP16.

Layers are FP16 (growing), FP16 rings (sliding window; never quantized), or
TurboQuant (packed codes + float32 norms, growing). A cache built with `max_kv_size=N`
bounds every layer that would hold more than N positions, as mlx-lm's RotatingKVCache
does: it keeps its first sink rows and its newest N - sinks positions (an FP16 ring with
sink rows, or a protected TurboQuant layer whose codes are a ring). A layer can also read
another layer's KV (`LayerSpec.shared_from`) and then owns no storage, or be
held by another pipeline stage (its spec is None) and have no place here at all.
Storage grows in steps like mlx-lm's KVCache, so a token does not reallocate.
"FP16" names the uncompressed rows throughout; they are stored in the model's dtype
(float16, bfloat16, or float32 for a float32 model), as mlx-lm's KVCache stores them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Sequence

import mlx.core as mx

from ..gpu.quantize import tq_quantize
from ..quant.config import DEFAULT_PRESET, TurboQuantConfig, get_preset, warn_quality
from ..quant.tables import SIDES, LayerQuant, side_quant
from . import io, window
from .spec import LayerSpec

# The first positions an FP16 layer of a bounded cache (`max_kv_size`) keeps: mlx-lm's
# make_prompt_cache builds RotatingKVCache(max_kv_size, keep=4). A protected TurboQuant
# layer keeps its preset's sink_rows instead.
BOUNDED_SINK_ROWS = 4
# What uncompressed ("FP16") rows may be stored as: the dtypes models compute K/V in.
ROW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@dataclass
class _Layer:
    """Storage and bookkeeping of one layer that owns its KV."""

    spec: LayerSpec
    quant: LayerQuant | None
    # Slots of a ring: an FP16 ring's rows, or a bounded protected layer's codes; None: grows.
    ring_capacity: int | None
    # Newest positions a query reads besides the sink rows (a sliding window, or max_kv_size
    # minus the sink rows); None: every position.
    keep: int | None = None
    # First positions kept in FP16 apart from the ring (a protected layer, a bounded FP16 ring).
    sink_rows: int = 0
    # A protected TurboQuant layer (window / sink rows / centring): slots of its FP16 ring of
    # recent rows, position p in slot p % recent_capacity: window_rows + commit_rows - 1 and room
    # for the write (`window.ring_modulus`; up to max_rows, so an M-row chunk never overwrites
    # a row it needs). recent_from: no position below it is held (set by a trim or a re-lay).
    recent_capacity: int = 0
    recent_from: int = 0
    recent_max: int = 0  # the largest modulus, the ring's length at its largest (fixed_layout)
    arrays: dict[str, mx.array] = field(default_factory=dict)
    capacity: int = 0
    offset: int = 0
    # (call signature, its step or None) of the layer's last call through attention's own step
    # (attention._planned_step: GrowingStep, RingStep or ProtectedStep): a shared plan, never part
    # of the cache's state.
    step_plan: tuple | None = field(default=None, compare=False, repr=False)


class KVStage:
    """FP16 staging rows for compressed layers and rings.

    One K and one V array of shape (B, H, max_rows, D) per distinct (H, D)
    among the staged layers; layers run one after another, so they share
    them. Blocks finish K/V here (norm, RoPE) before `commit_kv` stores them.
    """

    def __init__(self, batch_size: int, max_rows: int, dtype: mx.Dtype):
        self.batch_size = batch_size
        self.max_rows = max_rows
        self.dtype = dtype
        self.rows: dict[tuple[int, int], dict[str, mx.array]] = {}
        # (layer, side) -> (position, m) of the rows staged and not yet committed.
        self.pending: dict[tuple[int, str], tuple[int, int]] = {}

    def buffers(self, n_heads: int, head_dim: int) -> dict[str, mx.array]:
        key = (n_heads, head_dim)
        if key not in self.rows:
            shape = (self.batch_size, n_heads, self.max_rows, head_dim)
            self.rows[key] = {h: mx.zeros(shape, dtype=self.dtype) for h in SIDES}
        return self.rows[key]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pair in self.rows.values() for a in pair.values())


@dataclass(frozen=True)
class KVTarget:
    """Where `write` puts K or V rows for (layer, position): a slot or a staging row."""

    cache: "KVCacheManager"
    side: str
    layer: int
    position: int
    staged: bool

    def write(self, rows: mx.array) -> None:
        """Write (B, H, M, D) rows for positions [position, position + M)."""
        self.cache._write(self, rows)


class KVCacheManager:
    """Per-layer KV storage: FP16, FP16 ring, or TurboQuant-packed.

    Args:
        layers: one `LayerSpec` per attention layer of the model; None for a layer that
            another pipeline stage holds. Indices, the preset's layer policy and the
            per-layer rotations stay those of the whole model, so a stage's layers are
            compressed exactly as in one process.
        kv: a preset name from `PRESETS` or a `TurboQuantConfig`.
        batch_size: B, the number of sequences.
        max_rows: the largest M-row write (prefill chunk, speculative verify);
            sizes the staging rows and the slack rings keep beyond their window.
        max_context: if set, writing past this many positions is an error (bounded
            layers excepted: they never hold more than max_kv_size).
        max_kv_size: if set, a layer that would hold more positions keeps only its first
            sink rows and its newest max_kv_size - sinks positions (mlx-lm's rotating
            cache with keep=4); TurboQuant layers then need a protected preset.
        dtype: dtype of the uncompressed rows and staging (float16, bfloat16 or float32);
            "FP16" below names these rows whatever their dtype.
        step: growth step of storage, in positions.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        kv: str | TurboQuantConfig = DEFAULT_PRESET,
        *,
        batch_size: int = 1,
        max_rows: int = 512,
        max_context: int | None = None,
        max_kv_size: int | None = None,
        dtype: mx.Dtype = mx.float16,
        step: int = 256,
    ):
        self.config = get_preset(kv)
        warn_quality(self.config)
        self.specs = tuple(layers)
        if not any(s is not None for s in self.specs):
            raise ValueError("a KV cache needs at least one layer")
        if batch_size < 1 or max_rows < 1 or step < 1:
            raise ValueError(
                f"batch_size, max_rows and step must be >= 1, got {batch_size}, {max_rows}, {step}"
            )
        if dtype not in ROW_DTYPES:
            raise ValueError(f"KV row dtype must be float16, bfloat16 or float32, got {dtype}")
        if max_kv_size is not None:
            if not isinstance(max_kv_size, int) or max_kv_size < 1:
                raise ValueError(f"max_kv_size must be an int >= 1, got {max_kv_size!r}")
            if not self.config.is_fp16 and not self.config.is_protected:
                raise ValueError(
                    f"max_kv_size needs a protected preset (window or sink rows): {self.config.name!r} "
                    "compresses every position, so its codes cannot rotate behind sink rows"
                )
        self.batch_size = batch_size
        self.max_rows = max_rows
        self.max_context = max_context
        self.max_kv_size = max_kv_size
        self.dtype = dtype
        self.step = step
        self.stage = KVStage(batch_size, max_rows, dtype)
        self._layers: dict[int, _Layer] = {}
        n = len(self.specs)
        for i, spec in enumerate(self.specs):
            if spec is None:  # held by another pipeline stage
                continue
            self._check_spec(i, spec)
            if spec.shared_from is not None:
                # The owner's compression applies; a policy naming the reader would be a silent no-op.
                if i in set(self.config.fp16_layers) | set(self.config.quantize_layers or ()):
                    raise ValueError(
                        f"preset {self.config.name!r} names layer {i}, which reads layer {spec.shared_from}'s "
                        f"KV and owns none: name the owner, layer {spec.shared_from}"
                    )
                continue
            sliding = spec.window is not None
            quant = None
            if self.config.is_quantized_layer(i, n, sliding=sliding):
                quant = LayerQuant(
                    layer=i,
                    k=side_quant(self.config.k_bits, spec.head_dim, self.config.rotation, self.config.seed, i, "k"),
                    v=side_quant(self.config.v_bits, spec.head_dim, self.config.rotation, self.config.seed, i, "v"),
                )
            l = self._layers[i] = self._new_layer(spec, quant)
            if l.recent_capacity or l.sink_rows:
                l.arrays.update(self._empty_fixed(l))

    def _new_layer(self, spec: LayerSpec, quant: LayerQuant | None) -> _Layer:
        protected = quant is not None and self.config.is_protected
        keep, sinks = spec.window, self.config.sink_rows if protected else 0
        N = self.max_kv_size
        if N is not None and (keep is None or keep > N):
            sinks = self.config.sink_rows if quant is not None else BOUNDED_SINK_ROWS
            if N <= sinks:
                raise ValueError(f"max_kv_size={N} must exceed the {sinks} sink rows a bounded layer keeps")
            keep = N - sinks
            if quant is not None and keep <= self.config.window_rows:  # the FP16 window holds it all
                quant, protected = None, False
        if protected:
            # Bounded: codes for the positions a query reads beyond the window, plus
            # max_rows - 1, so an M-row chunk's first row still finds its oldest code.
            ring = None if keep is None else keep - self.config.window_rows + self.max_rows - 1
            # The ring: the uncommitted rows a query may read at most, and an M-row write.
            recent = self.config.uncommitted_rows + self.max_rows
            return _Layer(spec, quant, ring, keep, sinks, recent_capacity=recent, recent_max=recent)
        # A ring keeps max_rows - 1 positions beyond its window, so an
        # M-row write never overwrites a key that a row of the same chunk needs.
        ring = None if keep is None else keep + self.max_rows - 1
        return _Layer(spec, quant, ring, keep, sinks)

    def _check_spec(self, i: int, spec: LayerSpec) -> None:
        if spec.n_kv_heads < 1 or spec.head_dim < 1:
            raise ValueError(f"layer {i}: n_kv_heads and head_dim must be >= 1, got {spec}")
        if spec.window is not None and spec.window < 1:
            raise ValueError(f"layer {i}: window must be >= 1, got {spec.window}")
        src = spec.shared_from
        if src is not None:
            if not 0 <= src < i or (self.specs[src] is not None and self.specs[src].shared_from is not None):
                raise ValueError(
                    f"layer {i} shares layer {src}'s KV: the owner must be an earlier layer that owns storage"
                )
            if self.specs[src] is None:
                raise ValueError(
                    f"layer {i} shares layer {src}'s KV, which this cache does not hold: "
                    "a pipeline stage must hold a KV-shared layer together with its owner"
                )
            owner = self.specs[src]
            if (owner.n_kv_heads, owner.head_dim, owner.window) != (spec.n_kv_heads, spec.head_dim, spec.window):
                raise ValueError(f"layer {i} shares layer {src}'s KV but their shapes or windows differ")

    def __deepcopy__(self, memo) -> "KVCacheManager":
        # Tables are immutable and shared; storage arrays get new objects, since
        # a slice update mutates the array object it is applied to.
        new = copy.copy(self)
        new._layers = {
            i: replace(l, arrays={n: mx.array(a) for n, a in l.arrays.items()}) for i, l in self._layers.items()
        }
        new.stage = copy.copy(self.stage)
        new.stage.rows = {key: {h: mx.array(a) for h, a in pair.items()} for key, pair in self.stage.rows.items()}
        new.stage.pending = dict(self.stage.pending)
        return new

    # -- layout -----------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.specs)

    @property
    def held_layers(self) -> list[int]:
        """Indices of the layers this cache holds (all of them unless it is a pipeline stage's)."""
        return [i for i, s in enumerate(self.specs) if s is not None]

    def owner(self, layer: int) -> int:
        """The layer whose storage `layer` reads (itself unless KV-shared)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range for a {self.n_layers}-layer cache")
        if self.specs[layer] is None:
            held = self.held_layers
            raise ValueError(
                f"layer {layer} is held by another pipeline stage; "
                f"this cache holds layers {held[0]}..{held[-1]}"
            )
        src = self.specs[layer].shared_from
        return layer if src is None else src

    def owned_layers(self) -> dict[int, "_Layer"]:
        """The layers that own storage, by index (for cache files and adapters)."""
        return self._layers

    def storage_layout(self, layer: int) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
        """Name -> (trailing shape, dtype) of each storage array of `layer` (an owner)."""
        return self._storage_layout(self._layers[layer])

    def _layer(self, layer: int) -> _Layer:
        l = self._layers.get(layer)  # an owner: itself, without owner()'s checks
        return l if l is not None else self._layers[self.owner(layer)]

    def layer_quant(self, layer: int) -> LayerQuant | None:
        """The TurboQuant tables of `layer`, or None if it is FP16."""
        return self._layer(layer).quant

    def quant_tables(self) -> dict[int, LayerQuant]:
        """Tables of every compressed layer that owns storage, by layer index."""
        return {i: l.quant for i, l in self._layers.items() if l.quant is not None}

    def is_staged(self, layer: int) -> bool:
        """Whether writes to `layer` go through staging (compressed layers and rings)."""
        l = self._layer(layer)
        return l.quant is not None or l.ring_capacity is not None

    def ring_capacity(self, layer: int) -> int | None:
        """Slots of `layer`'s ring (an FP16 ring's rows, a bounded protected layer's codes), or
        None if its storage grows."""
        return self._layer(layer).ring_capacity

    def layer_arrays(self, layer: int) -> dict[str, mx.array]:
        """The storage arrays of `layer` (keys/values, or k_codes/k_norms/v_codes/v_norms)."""
        return self._layer(layer).arrays

    def depends_on(self, x: mx.array) -> None:
        """Make the storage of the last layer held here depend on `x`, so evaluating the cache
        evaluates `x` too: a pipeline stage passes its send of the activations, which a
        prefill that evaluates only the cache must still run (the next stage waits for it)."""
        l = self._layers[max(self._layers)]
        l.arrays = {name: mx.depends(a, x) for name, a in l.arrays.items()}

    # -- positions ----------------------------------------------------------

    def layer_offset(self, layer: int) -> int:
        """Positions committed in `layer`."""
        return self._layer(layer).offset

    @property
    def offset(self) -> int:
        """Positions committed in every layer."""
        return min(l.offset for l in self._layers.values())

    def trim(self, n: int) -> int:
        """Drop the last n positions of every layer; returns n.

        A ring can give back at most the positions it keeps beyond its window
        (max_rows); older ones were overwritten. A protected layer can give back the FP16
        rows its ring holds beyond its uncommitted rows (RING_SLACK_ROWS between chunks, a
        chunk's rows after one; its codes then follow), counted from before an earlier trim.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"trim needs a non-negative int, got {n!r}")
        # A write not yet committed took ring slots of the oldest rows beyond the window.
        written: dict[int, int] = {}
        for (j, _), (_, m) in self.stage.pending.items():
            written[j] = max(written.get(j, 0), m)
        for i, l in self._layers.items():
            if n > l.offset:
                raise ValueError(f"cannot trim {n} positions: layer {i} holds only {l.offset}")
            if l.ring_capacity is not None and l.quant is None:
                lowest = max(0, l.offset - l.ring_capacity)  # oldest position still in the ring
                keep_from = l.offset - n - l.keep + 1  # oldest the next token attends to
                if keep_from < lowest:
                    raise ValueError(
                        f"cannot trim {n} positions: sliding layer {i} keeps only "
                        f"{l.ring_capacity - l.keep + 1} positions beyond its window"
                    )
            w = written.get(i, 0)
            beyond = l.recent_capacity - self.config.uncommitted_rows - w
            if l.recent_capacity and n > beyond:
                raise ValueError(
                    f"cannot trim {n} positions: layer {i} keeps only {beyond} FP16 rows "
                    "beyond its window to quantize again"
                    + (f" ({w} ring slots hold an uncommitted write)" if w else "")
                )
            if l.recent_capacity and max(0, l.offset - n - self.config.uncommitted_rows) < l.recent_from:
                raise ValueError(
                    f"cannot trim {n} positions: layer {i}'s FP16 ring no longer holds positions "
                    f"below {l.recent_from} (an earlier trim, or a chunk's write, took their slots)"
                )
        for i, l in self._layers.items():
            if l.recent_capacity:  # the slots past the new end are the next write's
                l.recent_from = max(l.recent_from, l.offset + written.get(i, 0) - l.recent_capacity)
            l.offset -= n
        self.stage.pending.clear()
        return n

    # -- bytes --------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes held by K/V storage (allocated capacity; staging excluded)."""
        return sum(a.nbytes for l in self._layers.values() for a in l.arrays.values())

    def layer_nbytes(self, layer: int) -> int:
        return sum(a.nbytes for a in self._layers[layer].arrays.values())

    def bytes_in_use(self) -> tuple[int, int]:
        """(stored, uncompressed). stored: the bytes the positions a query reads take as stored,
        codes and norms for the quantized ones, uncompressed rows for the rest (window, sinks,
        uncommitted rows, FP16 layers), and each key mean; the slack of growing storage and
        rings, and staging, left out. uncompressed: the same positions as K and V rows of this
        cache's dtype, what mlx-lm's KVCache (RotatingKVCache for a sliding layer) holds."""
        stored = full = 0
        for l in self._layers.values():
            rows, coded = self._held_positions(l)
            heads, d = self.batch_size * l.spec.n_kv_heads, l.spec.head_dim
            row = 2 * heads * d * self.dtype.size  # one position's K and V rows
            stored += rows * row
            if coded:  # uint32 code words and a float32 norm per side (`_storage_layout`)
                stored += coded * heads * 4 * (l.quant.k.words + l.quant.v.words + 2)
            stored += l.arrays["k_mean"].nbytes if "k_mean" in l.arrays else 0
            full += (rows + coded) * row
        return stored, full

    def _held_positions(self, l: _Layer) -> tuple[int, int]:
        """(uncompressed, quantized): how many positions a query of `l` reads from each."""
        n, sinks = l.offset, min(l.offset, l.sink_rows)
        first = l.sink_rows if l.keep is None else max(l.sink_rows, n - l.keep)  # oldest non-sink kept
        if l.quant is None:
            return sinks + max(0, n - first), 0
        end = max(first, self.config.committed_end(n) if l.recent_capacity else n)  # codes below it
        return sinks + max(0, n - end), end - first if n > first else 0

    def fp16_nbytes(self) -> int:
        """What the same allocated capacity would take as FP16 K and V (a protected layer: the
        capacity an FP16 layer would have allocated for its positions)."""
        total = 0
        for l in self._layers.values():
            if l.recent_capacity:
                rows = -(-l.offset // self.step) * self.step
                if l.keep is not None:  # bounded: what an FP16 bounded ring would hold
                    rows = min(rows, l.keep + self.max_rows - 1 + l.sink_rows)
            else:
                rows = l.capacity + l.sink_rows
            total += 2 * self.batch_size * l.spec.n_kv_heads * rows * l.spec.head_dim * 2
        return total

    def summary(self) -> str:
        """A printable table: per layer its kind, shape, offset and bytes."""
        lines = [f"KV cache  preset={self.config.name}  B={self.batch_size}  offset={self.offset}"]
        lines.append(f"{'layer':>5}  {'kind':<22} {'heads':>5} {'dim':>4} {'offset':>7} {'bytes':>12}")
        for i, spec in enumerate(self.specs):
            if spec is None:
                continue
            if spec.shared_from is not None:
                kind, nbytes, off = f"shared -> {spec.shared_from}", 0, self.layer_offset(i)
            else:
                l = self._layers[i]
                if l.quant is not None:
                    kind = f"turboquant k{l.quant.k.bits}v{l.quant.v.bits}"
                    if l.recent_capacity:
                        kind += f" w{self.config.window_rows}s{self.config.sink_rows}"
                        kind += "c" if self.config.center_keys else ""
                    if l.keep is not None:
                        kind += f" keep={l.keep}"
                elif l.ring_capacity is not None:
                    kind = f"fp16 ring w={l.keep} cap={l.ring_capacity}"
                    kind += f" s{l.sink_rows}" if l.sink_rows else ""
                else:
                    kind = "fp16"
                nbytes, off = self.layer_nbytes(i), l.offset
            lines.append(f"{i:>5}  {kind:<22} {spec.n_kv_heads:>5} {spec.head_dim:>4} {off:>7} {nbytes:>12,}")
        stored, full = self.bytes_in_use()
        lines.append(f"total {self.nbytes:,} bytes (FP16 would be {self.fp16_nbytes():,}); in use "
                     f"{stored:,} (uncompressed {full:,})")
        return "\n".join(lines)

    # -- writes -------------------------------------------------------------

    def _check_rows(self, layer: int, position: int, rows: mx.array) -> _Layer:
        """Validate an M-row write; raises before anything is changed."""
        self.owner(layer)  # in range and held here
        if self.specs[layer].shared_from is not None:
            raise ValueError(
                f"layer {layer} reads layer {self.specs[layer].shared_from}'s KV and owns no storage; "
                "write to the owner"
            )
        l = self._layers[layer]
        spec = l.spec
        if not isinstance(rows, mx.array) or rows.ndim != 4:
            raise ValueError(f"layer {layer}: K/V rows must be a 4-D mx.array (B, H, M, D)")
        if not mx.issubdtype(rows.dtype, mx.floating):
            raise TypeError(f"layer {layer}: K/V rows must be floating point, got {rows.dtype}")
        B, H, M, D = rows.shape
        if B != self.batch_size:
            raise ValueError(f"layer {layer}: batch size {B} does not match the cache's {self.batch_size}")
        if H != spec.n_kv_heads:
            raise ValueError(f"layer {layer}: {H} KV heads given, the layer has {spec.n_kv_heads}")
        if D != spec.head_dim:
            raise ValueError(f"layer {layer}: head_dim {D} given, the layer has {spec.head_dim}")
        if M < 1:
            raise ValueError(f"layer {layer}: a write needs at least one row")
        if position != l.offset:
            raise ValueError(
                f"layer {layer}: write at position {position}, but the layer's next position is {l.offset}"
            )
        if self.is_staged(layer) and M > self.max_rows:
            what = "ring" if l.ring_capacity is not None else "staging"
            raise ValueError(
                f"layer {layer}: {M} rows at once exceed the {what} capacity of max_rows={self.max_rows}"
            )
        if l.ring_capacity is None and self.max_context is not None and position + M > self.max_context:
            raise ValueError(
                f"layer {layer}: positions up to {position + M} exceed max_context={self.max_context}"
            )
        return l

    def _write(self, target: KVTarget, rows: mx.array) -> None:
        l = self._check_rows(target.layer, target.position, rows)
        M = rows.shape[2]
        if l.recent_capacity:
            window.fit(self, l, target.position, M)  # the ring's room for M rows (both sides at once)
            window.write(self, l, target.side, target.position, rows.astype(self.dtype))
        elif target.staged:
            buf = self.stage.buffers(l.spec.n_kv_heads, l.spec.head_dim)
            buf[target.side][:, :, :M, :] = rows.astype(self.dtype)
        else:
            name = "keys" if target.side == "k" else "values"
            self._reserve(l, target.position + M)
            self._put(l, name, target.position, rows.astype(self.dtype))
        self.stage.pending[(target.layer, target.side)] = (target.position, M)

    def _reserve(self, l: _Layer, end: int) -> None:
        """Grow storage in whole steps (up to the ring size) so that `end` positions fit."""
        need = end if l.ring_capacity is None else min(end, l.ring_capacity)
        if need <= l.capacity:
            return
        new_cap = -(-need // self.step) * self.step
        if l.ring_capacity is not None:
            new_cap = min(new_cap, l.ring_capacity)
        for name, (tail, dtype) in self._storage_layout(l).items():
            shape = (self.batch_size, l.spec.n_kv_heads, new_cap - l.capacity, *tail)
            grown = mx.zeros(shape, dtype=dtype)
            old = l.arrays.get(name)
            l.arrays[name] = grown if old is None else mx.concatenate([old[:, :, : l.capacity], grown], axis=2)
        l.capacity = new_cap

    def _storage_layout(self, l: _Layer) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
        if l.quant is None:
            d = l.spec.head_dim
            return {"keys": ((d,), self.dtype), "values": ((d,), self.dtype)}
        return {
            "k_codes": ((l.quant.k.words,), mx.uint32),
            "k_norms": ((), mx.float32),
            "v_codes": ((l.quant.v.words,), mx.uint32),
            "v_norms": ((), mx.float32),
        }

    def _fixed_layout(self, l: _Layer) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
        return window.fixed_layout(l, self.config, self.batch_size, self.dtype)

    def _empty_fixed(self, l: _Layer) -> dict[str, mx.array]:
        return window.empty_fixed(self._fixed_layout(l))

    def fixed_layout(self, layer: int) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
        """Name -> (shape, dtype) of `layer`'s fixed-size arrays (a protected TurboQuant layer)."""
        return self._fixed_layout(self._layers[layer])

    def quantized_end(self, layer: int, end: int | None = None) -> int:
        """Positions below this are read from codes once `end` positions are committed (on a
        protected layer: all but the sink rows and the newest window_rows to window_rows +
        commit_rows - 1, `TurboQuantConfig.committed_end`; position p's codes sit in slot
        p - sink_rows)."""
        l = self._layer(layer)
        end = l.offset if end is None else end
        if not l.recent_capacity:
            return end
        return self.config.committed_end(end)

    def recent_capacity(self, layer: int) -> int:
        """Slots of a protected layer's FP16 ring (position p sits in slot p % capacity); 0
        for other layers."""
        return self._layer(layer).recent_capacity

    def ring_from(self, layer: int) -> int:
        """The oldest position a protected layer's FP16 ring still holds (a trim or a re-lay
        raises it; 0 for other layers). Adapters that save `layer_arrays` save it beside them
        and give it back to `set_layer_arrays`, so a later trim keeps to the rows held."""
        return self._layer(layer).recent_from

    def recent_positions(self, layer: int, end: int) -> mx.array:
        """Position held by each slot of a protected layer's recent ring once `end` positions
        are written (-1: not written)."""
        cap = self.recent_capacity(layer)
        s = mx.arange(self._layer(layer).arrays["k_recent"].shape[2])
        return mx.where(s < end, s + cap * ((end - 1 - s) // cap), -1)

    def _put(self, l: _Layer, name: str, position: int, rows: mx.array) -> None:
        """Slice-update rows at `position` (wrapping on a ring)."""
        M = rows.shape[2]
        arr = l.arrays[name]
        start = position if l.ring_capacity is None else position % l.ring_capacity
        first = min(M, l.capacity - start)
        arr[:, :, start : start + first] = rows if first == M else rows[:, :, :first]
        if first < M:  # wrapped around the ring
            arr[:, :, : M - first] = rows[:, :, first:]

    def commit(self, layer: int, position: int, m: int) -> None:
        """See `commit_kv`."""
        for side in SIDES:
            if self.stage.pending.get((layer, side)) != (position, m):
                raise ValueError(
                    f"layer {layer}: commit of {m} rows at position {position} without matching "
                    f"{side.upper()} rows written through kv_write_target"
                )
        l = self._layers[layer]
        if l.recent_capacity:
            window.commit(self, l, position, m)
        elif self.is_staged(layer):
            buf = self.stage.buffers(l.spec.n_kv_heads, l.spec.head_dim)
            rows = {}
            for side in SIDES:
                if l.quant is None:  # ring: copy the FP16 rows in
                    rows["keys" if side == "k" else "values"] = buf[side][:, :, :m]
                else:
                    codes, norms = tq_quantize(buf[side][:, :, :m], l.quant.side(side))
                    rows[f"{side}_codes"], rows[f"{side}_norms"] = codes, norms
            self._reserve(l, position + m)
            for name, r in rows.items():
                self._put(l, name, position, r)
            if position < l.sink_rows:  # a bounded ring's first positions, kept apart
                n = min(l.sink_rows, position + m) - position
                for side in SIDES:
                    l.arrays[f"{side}_sinks"][:, :, position : position + n] = buf[side][:, :, :n]
        for side in SIDES:
            del self.stage.pending[(layer, side)]
        l.offset = position + m

    def layer_keep(self, layer: int) -> int | None:
        """Newest positions a query of `layer` reads besides its sink rows (a sliding window,
        or what max_kv_size leaves); None if it reads every position."""
        return self._layer(layer).keep

    def sink_rows(self, layer: int) -> int:
        """First positions `layer` keeps in FP16 apart from its ring or codes."""
        return self._layer(layer).sink_rows

    def code_positions(self, layer: int, end: int) -> mx.array:
        """Position held by each code slot of a protected layer once `end` positions are
        written (-1: none): slot s holds position s + sink_rows, or on a bounded layer the
        newest such position whose slot is s modulo the ring."""
        l = self._layer(layer)
        n = self.quantized_end(layer, end) - l.sink_rows  # code rows written
        s = mx.arange(l.capacity)
        if l.ring_capacity is not None:
            s_pos = s + l.ring_capacity * ((n - 1 - s) // l.ring_capacity)
        else:
            s_pos = s
        return mx.where(s < n, s_pos + l.sink_rows, -1)

    def slot_positions(self, layer: int, end: int) -> mx.array:
        """Position held by each storage slot [0, capacity) once `end` positions are written.

        Slots not yet written hold -1. Linear storage: slot s holds position s.
        """
        l = self._layer(layer)
        s = mx.arange(l.capacity)
        if l.ring_capacity is None:
            return mx.where(s < end, s, -1)
        cap = l.ring_capacity
        pos = s + cap * ((end - 1 - s) // cap)
        return mx.where(s < end, pos, -1)

    def set_layer_arrays(
        self, layer: int, arrays: dict[str, mx.array], offset: int, ring_from: int = 0
    ) -> None:
        """Replace a layer's storage with `arrays` (named as `layer_arrays` gives them).

        For adapters that hold storage between calls in another form (mlx-lm's
        prompt-cache files, batch merge / filter): a growing layer, or a bounded
        (max_kv_size) protected layer, whose codes ring maps slots to positions from
        `offset` alone. `ring_from` is `ring_from(layer)` of the cache the arrays came
        from. Everything is checked before anything changes; `arrays` = {} with offset 0
        empties the layer.
        """
        if not 0 <= layer < self.n_layers or layer not in self._layers:
            raise ValueError(f"layer {layer} does not own storage in this {self.n_layers}-layer cache")
        l = self._layers[layer]
        bounded = l.ring_capacity is not None and l.recent_capacity > 0
        if l.ring_capacity is not None and not bounded:
            what = "a bounded (max_kv_size)" if l.keep != l.spec.window else "a sliding-window"
            raise ValueError(
                f"layer {layer} is {what} FP16 ring; only growing and protected layers can be set"
            )
        layout = self._storage_layout(l) if arrays else {}
        if l.recent_capacity and not set(layout) & set(arrays):  # no row has left the window yet
            layout = {}
            if self.quantized_end(layer, offset) > self.config.sink_rows:
                raise ValueError(f"layer {layer}: {offset} positions need codes, and none are given")
        fixed = self._fixed_layout(l) if arrays else {}
        if set(arrays) != set(layout) | set(fixed):
            raise ValueError(
                f"layer {layer}: arrays {sorted(arrays)} given, the layer stores {sorted(layout) + sorted(fixed)}"
            )
        caps = {arrays[n].shape[2] for n in layout if arrays[n].ndim >= 3}
        cap = caps.pop() if len(caps) == 1 else 0
        for name, (tail, dtype) in layout.items():
            a = arrays[name]
            want = (self.batch_size, l.spec.n_kv_heads, cap, *tail)
            if a.shape != want or a.dtype != dtype:
                raise ValueError(f"layer {layer}: {name} is {(a.shape, a.dtype)}, expected {(want, dtype)}")
        for name, (want, dtype) in fixed.items():
            window.check_fixed(layer, name, arrays[name], want, dtype)
        if bounded and cap > l.ring_capacity:
            raise ValueError(
                f"layer {layer}: {cap} code slots given, the bounded layer's ring holds {l.ring_capacity}"
            )
        c = self.config
        held = cap + c.uncommitted_rows + c.sink_rows if l.recent_capacity else cap
        if bounded and cap == l.ring_capacity:  # a full ring: any later position maps onto it
            held = None
        if not isinstance(offset, int) or offset < 0 or (held is not None and offset > held):
            raise ValueError(f"layer {layer}: offset {offset!r} outside the {held} positions given")
        if not isinstance(ring_from, int) or not 0 <= ring_from <= offset:
            raise ValueError(f"layer {layer}: ring_from {ring_from!r} outside [0, offset {offset}]")
        recent = arrays.get("k_recent")
        if recent is not None:
            window.check_ring(self, layer, l, recent.shape[2], offset)
        codes_needed = self.quantized_end(layer, offset) - self.config.sink_rows if l.recent_capacity else 0
        if held is not None and codes_needed > cap:
            raise ValueError(f"layer {layer}: {offset} positions need more codes than the {cap} given")
        if self.max_context is not None and offset > self.max_context:
            raise ValueError(f"layer {layer}: offset {offset} exceeds max_context={self.max_context}")
        if not arrays:  # emptied: a protected layer starts over with empty fixed arrays
            arrays = self._empty_fixed(l)
        l.arrays, l.capacity, l.offset = dict(arrays), cap, offset
        if l.recent_capacity:
            window.adopt(l, ring_from)
        for side in SIDES:
            self.stage.pending.pop((layer, side), None)

    # -- state --------------------------------------------------------------

    def save(self, path: str, metadata: dict[str, str] | None = None) -> str:
        """Save storage and layout to a safetensors file, atomically; returns the path written.

        The file carries a SHA-256 digest of its tensors and metadata (the caller's
        `metadata` strings included), so a truncated or edited file is refused at load
        (`cache.io`).
        """
        return io.save(self, path, metadata)

    @classmethod
    def from_file(cls, path: str, return_metadata: bool = False):
        """Load a cache saved by `save`; a damaged or edited file raises ValueError.
        With return_metadata, returns (cache, the metadata given to `save`)."""
        return io.load(path, cls, return_metadata)

    def load_state(self, path: str) -> None:
        """Replace this cache's contents with a saved file of the same layout.

        The file is fully checked first; on any error this cache is unchanged.
        """
        other = KVCacheManager.from_file(path)
        mine = (self.config, self.specs, self.batch_size, self.dtype)
        theirs = (other.config, other.specs, other.batch_size, other.dtype)
        if mine != theirs:
            raise ValueError(f"KV cache file {path!r} has a different preset, layout, batch size or dtype")
        self.__dict__.update(other.__dict__)


def make_cache(model, kv: str | TurboQuantConfig = DEFAULT_PRESET, **kwargs) -> KVCacheManager:
    """A KVCacheManager laid out for `model` (anything with `kv_layer_specs()`).

    kwargs go to KVCacheManager (batch_size, max_rows, max_context, dtype, step). The
    row dtype defaults to the model's (`model_dtype`), so attention over uncompressed rows
    never casts the history.
    """
    kwargs.setdefault("dtype", model_dtype(model))
    return KVCacheManager(model.kv_layer_specs(), kv, **kwargs)


def model_dtype(model) -> mx.Dtype:
    """The dtype a model's K/V rows come in: that of its floating parameters (quantization
    scales included) where it is bfloat16 or float32, else float16. A float32 model (the
    CPU's dequantized weights, `ts.load`) stores float32 rows, as mlx-lm's KVCache does: on
    MLX's CPU backend casting 16-bit history back every step costs more than the attention
    over it (docs/backends.md, "The CPU backend's cache paths")."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters()) if hasattr(model, "parameters") else []
    floats = [a.dtype for _, a in params if mx.issubdtype(a.dtype, mx.floating)]
    return floats[0] if floats and floats[0] in (mx.bfloat16, mx.float32) else mx.float16


def kv_write_target(cache: KVCacheManager, side: str, layer: int, position: int) -> KVTarget:
    """Where `layer`'s finished K (side="k") or V ("v") rows at `position` go.

    The cache slot on an FP16 layer; an FP16 staging row on a TurboQuant layer,
    which `commit_kv` then quantizes into the slot.
    """
    if side not in SIDES:
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return KVTarget(cache, side, layer, position, staged=cache.is_staged(layer))


def commit_kv(cache: KVCacheManager, layer: int, position: int, m: int) -> None:
    """Make M written rows at `position` part of `layer`'s cache.

    TurboQuant layer: K and V staging rows are quantized (M rows at once) into
    packed codes + norms at `position`. Ring: the staged rows are copied in.
    Growing FP16 layer: the rows are already in their slots; only the layer's
    offset advances.
    """
    cache.commit(layer, position, m)


def store_kv(cache: KVCacheManager, layer: int, position: int, keys: mx.array, values: mx.array) -> None:
    """Write (B, H, M, D) keys and values at `position` and commit them."""
    if keys.shape != values.shape:
        raise ValueError(f"layer {layer}: keys {keys.shape} and values {values.shape} differ in shape")
    cache._check_rows(layer, position, values)  # both halves valid before either is written
    kv_write_target(cache, "k", layer, position).write(keys)
    kv_write_target(cache, "v", layer, position).write(values)
    commit_kv(cache, layer, position, keys.shape[2])
