"""TurboQuant presets as data.

A preset fixes the bits of each side (K and V), the rotation, the seed and a
per-layer policy. The bytes a token costs follow from it exactly:

    per side, per token, per KV head:
        FP16 side:        2·d bytes
        TurboQuant side:  4·packed_words(d, bits) bytes of codes + 4 bytes of norm

Norms are float32: ||x|| of real keys can exceed fp16's 65504, and 4 bytes per
vector is <7% of a 4-bit row at d = 128.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields, replace

import mlx.core as mx

from .packing import packed_words
from .rotation import ROTATION_KINDS

FP16_BITS = 16
QUANT_BITS = (2, 3, 4, 8)
NORM_BYTES = 4
PLAIN_SUFFIX = "-plain"  # a preset's name with its protection off (TurboQuantConfig.plain)


@dataclass(frozen=True)
class TurboQuantConfig:
    """A KV cache preset.

    Attributes:
        name: preset name ("tq4", "k8v4", ...).
        k_bits: bits per key coordinate: 2, 3, 4 or 8, or 16 for an FP16 cache.
        v_bits: bits per value coordinate, same choices.
        rotation: "auto" (Hadamard for power-of-two head_dim, dense otherwise),
            "hadamard" or "dense".
        seed: base seed; each (layer, side) draws its own rotation from it.
        fp16_first: the first N attention layers stay FP16.
        fp16_last: the last N attention layers stay FP16.
        fp16_layers: more layers, by index, that stay FP16.
        quantize_layers: if set, exactly these layers are compressed (the
            first/last rules then do not apply). Sliding-window layers are
            always FP16 rings; naming one here is an error.
        window_rows: a compressed layer keeps at least its newest W positions in FP16 and
            quantizes rows once they leave this window (0: every row on write).
        sink_rows: a compressed layer keeps its first S positions in FP16.
        center_keys: subtract each KV head's per-channel key mean (over the W
            positions after the sink rows) before quantizing keys; attention adds
            q·mean back to the scores of quantized keys. Needs window_rows >= 1.
        commit_rows: a compressed layer with FP16 rows quantizes them B at a time, once
            window_rows + B are past its last commit, so a row reads between W and
            W + B - 1 FP16 positions besides its sink rows (`committed_end`), and only
            one decode step in B writes codes (1: a row leaves the window at each step).
    """

    name: str
    k_bits: int
    v_bits: int
    rotation: str = "auto"
    seed: int = 0
    fp16_first: int = 0
    fp16_last: int = 0
    fp16_layers: tuple[int, ...] = ()
    quantize_layers: tuple[int, ...] | None = None
    window_rows: int = 0
    sink_rows: int = 0
    center_keys: bool = False
    commit_rows: int = 1

    def __post_init__(self):
        is_fp16 = (self.k_bits, self.v_bits) == (FP16_BITS, FP16_BITS)
        for side, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
            if not is_fp16 and bits not in QUANT_BITS:
                raise ValueError(
                    f"preset {self.name!r}: {side}={bits} is not supported; "
                    f"TurboQuant bits are {QUANT_BITS} (or 16 on both sides for FP16)"
                )
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(
                f"preset {self.name!r}: unknown rotation {self.rotation!r}; valid: {ROTATION_KINDS}"
            )
        if min(self.fp16_first, self.fp16_last) < 0:
            raise ValueError(f"preset {self.name!r}: fp16_first/fp16_last must be >= 0")
        if min(self.window_rows, self.sink_rows) < 0:
            raise ValueError(f"preset {self.name!r}: window_rows and sink_rows must be >= 0")
        if self.center_keys and self.window_rows < 1:
            raise ValueError(
                f"preset {self.name!r}: center_keys estimates the mean over the FP16 window: "
                "it needs window_rows >= 1"
            )
        if not isinstance(self.commit_rows, int) or self.commit_rows < 1:
            raise ValueError(
                f"preset {self.name!r}: commit_rows must be an int >= 1, got {self.commit_rows!r}"
            )
        if self.commit_rows > 1 and not self.is_protected:
            raise ValueError(
                f"preset {self.name!r}: commit_rows={self.commit_rows} needs FP16 rows to commit from "
                "(window_rows, sink_rows or center_keys); without them every row is quantized on write"
            )
        object.__setattr__(self, "fp16_layers", tuple(self.fp16_layers))
        if self.quantize_layers is not None:
            object.__setattr__(self, "quantize_layers", tuple(self.quantize_layers))

    @property
    def is_fp16(self) -> bool:
        """True when no layer is compressed."""
        return self.k_bits == FP16_BITS

    @property
    def is_protected(self) -> bool:
        """True when compressed layers keep FP16 rows (window, sinks) or centre their keys."""
        return not self.is_fp16 and bool(self.window_rows or self.sink_rows or self.center_keys)

    @property
    def uncommitted_rows(self) -> int:
        """The most positions past its sink rows a protected layer holds in FP16 only: the
        window and an unfinished commit block (W + B - 1)."""
        return self.window_rows + self.commit_rows - 1

    def committed_end(self, n):
        """On a protected layer holding `n` positions (an int, or an mx.array of them), the end
        of the positions with codes, [sink_rows, committed_end(n)): sink_rows + the multiple of
        commit_rows at most n - sink_rows - window_rows. Query row t reads its positions from
        committed_end(t + 1) on in FP16."""
        S, W, B = self.sink_rows, self.window_rows, self.commit_rows
        over = n - W - S
        over = max(over, 0) if isinstance(over, int) else mx.maximum(over, 0)
        return S + over // B * B

    def side_bytes_per_token(self, bits: int, head_dim: int) -> int:
        if bits == FP16_BITS:
            return 2 * head_dim
        return 4 * packed_words(head_dim, bits) + NORM_BYTES

    def bytes_per_token(self, head_dim: int) -> int:
        """K + V bytes of one token for one KV head of a compressed layer.

        Codes (whole uint32 words) plus one float32 norm per side; an FP16
        preset gives 4·head_dim.
        """
        return self.side_bytes_per_token(self.k_bits, head_dim) + self.side_bytes_per_token(
            self.v_bits, head_dim
        )

    def ratio_vs_fp16(self, head_dim: int) -> float:
        return self.bytes_per_token(head_dim) / (4 * head_dim)

    def is_quantized_layer(self, layer: int, n_layers: int, sliding: bool = False) -> bool:
        """Whether `layer` (of n_layers) is compressed under this preset's policy."""
        if self.is_fp16:
            return False
        if self.quantize_layers is not None:
            if layer in self.quantize_layers and sliding:
                raise ValueError(
                    f"preset {self.name!r} asks to compress layer {layer}, a sliding-window "
                    "layer: sliding-window layers are FP16 rings and are never quantized"
                )
            return layer in self.quantize_layers
        if sliding or layer in self.fp16_layers:
            return False
        return self.fp16_first <= layer < n_layers - self.fp16_last

    def plain(self) -> "TurboQuantConfig":
        """The same bits as plain TurboQuant: every row quantized on write, keys not centred."""
        if self.is_fp16:
            return self
        return self.with_(
            name=f"{self.name}{PLAIN_SUFFIX}", window_rows=0, sink_rows=0, center_keys=False, commit_rows=1
        )

    def to_json(self) -> str:
        """The preset as JSON (the form cache files and the mlx-lm adapter store)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TurboQuantConfig":
        """The preset `to_json` wrote; unknown or missing fields raise ValueError."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a KV preset must be a JSON object: {e}") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not set(d) <= names:
            raise ValueError(f"not a KV preset: {text[:200]!r}")
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        except TypeError as e:
            raise ValueError(f"not a KV preset: {e}") from None

    def with_(self, **changes) -> "TurboQuantConfig":
        """A copy with some fields changed (the name too, unless given)."""
        changes.setdefault("name", f"{self.name}*")
        return replace(self, **changes)


# What every compressed preset keeps exact: at least the newest 128 positions and the first 4 in
# FP16, and keys centred per KV head. Without them tq4 costs +8% perplexity on SmolLM2-135M and
# breaks biased-key models; with them it is within a fraction of a percent
# (benchmarks/results/quality.md). Turn a part off with `.with_(window_rows=0)`, all of it with `.plain()`.
# Rows are committed 64 at a time, so 63 decode steps in 64 write no codes: fewer graph nodes
# per step (benchmarks/results/generate_e2e.md), and each row reads 128 to 191 FP16 positions.
PROTECTION = dict(window_rows=128, sink_rows=4, center_keys=True, commit_rows=64)
# tq4 keeps 256 positions in FP16: at 8k tokens its mean KL to FP16 is 17-32% lower than with
# 128 on both models and texts (benchmarks/results/quality.md, `tq4:window_rows=128`).
TQ4_WINDOW_ROWS = 256
# tq3 keeps 512 positions in FP16: +0.9% to +2.2% perplexity at 8k tokens on SmolLM2-135M and
# Gemma-3-270M, against +2.4% to +5.0% with 128 (benchmarks/results/quality.md).
TQ3_WINDOW_ROWS = 512

PRESETS: dict[str, TurboQuantConfig] = {
    c.name: c
    for c in (
        TurboQuantConfig("fp16", FP16_BITS, FP16_BITS),
        TurboQuantConfig("tq4", 4, 4, **{**PROTECTION, "window_rows": TQ4_WINDOW_ROWS}),
        TurboQuantConfig("tq3", 3, 3, **{**PROTECTION, "window_rows": TQ3_WINDOW_ROWS}),
        TurboQuantConfig("tq2", 2, 2, **PROTECTION),
        TurboQuantConfig("k4v3", 4, 3, **PROTECTION),
        TurboQuantConfig("k8v4", 8, 4, **PROTECTION),
        TurboQuantConfig("k8v3", 8, 3, **PROTECTION),
    )
}


# The default preset of generation, the CLI, the cache manager and the mlx-lm drop-in: within
# +0.5% perplexity of FP16, and the closest in KL, on every model of
# benchmarks/results/quality.md (99% top-1 agreement on SmolLM2-135M).
DEFAULT_PRESET = "k8v4"


# Shipped presets measured to lose quality a user should hear about when a cache uses them
# (benchmarks/results/quality.md): preset name -> what was measured.
QUALITY_WARNINGS = {
    "tq2": "+2.2% and +2.4% perplexity against the FP16 cache on SmolLM2-135M and Gemma-3-270M "
    "at 1k tokens, +10.7% and +18.7% at 8k (84% and 77% top-1 agreement), where k8v4 and tq4 "
    "stay within about 1% (benchmarks/results/quality.md)",
}


def warn_quality(config: TurboQuantConfig, stacklevel: int = 3) -> None:
    """A UserWarning when `config` is a shipped preset measured to lose quality, or a variant of
    one with its bits (`tq2:seed=1`, `tq2-plain`)."""
    base = _base_name(config.name)
    note = QUALITY_WARNINGS.get(base)
    if note is not None and (config.k_bits, config.v_bits) == (PRESETS[base].k_bits, PRESETS[base].v_bits):
        warnings.warn(f"KV preset {config.name!r}: {note}", UserWarning, stacklevel=stacklevel)


def _base_name(text: str) -> str:
    """The PRESETS name a preset string starts from: `tq2` of `tq2-plain:seed=1`."""
    return text.split(":")[0].removesuffix(PLAIN_SUFFIX)


def parse_flag(text: str) -> bool:
    """A boolean written as mlx-lm's flags take it (true/false, 1/0, yes/no, on/off)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


# The fields a preset string may change (`NAME:field=value`), each with its parser.
PRESET_FIELDS = {
    "k_bits": int, "v_bits": int, "seed": int, "window_rows": int, "sink_rows": int, "commit_rows": int,
    "fp16_first": int, "fp16_last": int, "center_keys": parse_flag, "rotation": str,
}  # fmt: skip


def get_preset(kv: "str | TurboQuantConfig") -> TurboQuantConfig:
    """Resolve a preset (a config passes through). A string is a name from PRESETS, optionally
    with `-plain` (the protection off: `TurboQuantConfig.plain`), then any number of
    `:field=value` changes (`PRESET_FIELDS`): `tq4`, `tq4-plain`, `tq4:window_rows=512`,
    `k8v4:seed=1:sink_rows=0`. The config is named by the string. Errors name what is wrong
    and the valid choices."""
    if isinstance(kv, TurboQuantConfig):
        return kv
    if not isinstance(kv, str):
        raise ValueError(f"a KV preset is a name or a TurboQuantConfig, got {type(kv).__name__}")
    base, *changes = kv.split(":")
    name = _base_name(base)
    if name not in PRESETS:
        raise ValueError(
            f"unknown KV preset {name!r}; valid presets: {', '.join(PRESETS)} "
            f"(NAME{PLAIN_SUFFIX} turns the protection off, NAME:field=value changes a field)"
        )
    config = PRESETS[name].plain() if name != base else PRESETS[name]
    if not changes:
        return config
    values = {}
    for change in changes:
        field, sep, text = change.partition("=")
        if not sep or field not in PRESET_FIELDS:
            raise ValueError(
                f"KV preset {kv!r}: {change!r} is not field=value with a field from "
                f"{', '.join(PRESET_FIELDS)}"
            )
        try:
            values[field] = PRESET_FIELDS[field](text)
        except ValueError:
            raise ValueError(f"KV preset {kv!r}: {field}={text!r} is not a valid value") from None
    return config.with_(name=kv, **values)
