"""Fast paths for a model that runs on MLX's CPU backend, applied by `ts.load` there.

MLX's CPU backend has no kernel of its own for `mx.fast.rope` or `mx.fast.rms_norm`: each call
runs as a composition of ops, and on the CPU every op costs microseconds to dispatch. A decode
step of the default model (30 layers, a one-row input) spent ~110 µs in each of its 60 RoPE
calls and ~40 µs in each of its 61 RMSNorms, a quarter of the step (docs/backends.md, "The CPU
backend's small ops"). Here a RoPE module's rotation is taken from cos / sin tables that the
module itself writes once per step, shared by every layer with the same rotation, and
`nn.RMSNorm` runs as one compiled graph. Both compute what they replace, within float32
rounding; a RoPE module whose output the tables do not reproduce is left as it is.

Packed (quantized) Linear and Embedding layers take `cpu_ext.quantized_matmul`, which reads
the packed weights directly (`packed_weight_paths`).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import cpu_ext

# Offsets and row counts at which a RoPE module's tables are checked against it before it is
# replaced, and the largest difference allowed (relative to 1 + the output's largest value).
_CHECK_AT = ((0, 1), (7, 5), (4093, 1))
_CHECK_TOLERANCE = 1e-5


def packed_weights_supported(model: nn.Module) -> bool:
    """Whether every quantized layer of `model` can take `cpu_ext.quantized_matmul` here (and
    the model has one). A layer of another kind with packed weights (mlx-lm's quantized MoE
    experts, `QuantizedSwitchLinear`) would keep MLX's slow CPU path: then the answer is no."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    layers = [m for _, m in model.named_modules() if "scales" in m]
    if not layers or not all(type(m) in kinds for m in layers):
        return False
    if not all(cpu_ext.supports(m.group_size, m.bits, m.mode) for m in layers):
        return False
    return cpu_ext.available()


def packed_weight_paths(model: nn.Module) -> int:
    """Give `model`'s quantized Linear / Embedding layers the packed-weight product of
    `cpu_ext` (`PackedLinear`, `PackedEmbedding`), in place; returns how many it replaced.
    Call it on loaded weights, where `packed_weights_supported(model)`."""
    packed = {nn.QuantizedLinear: PackedLinear, nn.QuantizedEmbedding: PackedEmbedding}
    done = 0
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if type(child) in packed:
                setattr(module, name, packed[type(child)](child))
                done += 1
    return done


def _take_packed(new: nn.Module, layer: nn.Module) -> None:
    """`layer`'s quantization and packed weight on `new`, as the kernel reads them: the weight
    row-contiguous, its scales and biases float32."""
    new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
    new.weight = mx.contiguous(layer.weight)
    new.scales = mx.contiguous(layer.scales.astype(mx.float32))
    new.biases = mx.contiguous(layer.biases.astype(mx.float32))


class PackedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` (the same parameters under the same names) whose product reads the
    packed weight on the CPU (`cpu_ext.quantized_matmul`)."""

    def __init__(self, layer: nn.QuantizedLinear):
        nn.Module.__init__(self)
        _take_packed(self, layer)
        if "bias" in layer:
            self.bias = layer.bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = _packed_product(self, x)
        return y + self["bias"] if "bias" in self else y


class PackedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output projection) reads the packed
    weight on the CPU (`cpu_ext.quantized_matmul`); lookups are MLX's."""

    def __init__(self, layer: nn.QuantizedEmbedding):
        nn.Module.__init__(self)
        _take_packed(self, layer)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.freeze()

    def as_linear(self, x: mx.array) -> mx.array:
        return _packed_product(self, x)


def _packed_product(layer: nn.Module, x: mx.array) -> mx.array:
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    return cpu_ext.quantized_matmul(x, w, scales, biases, layer.group_size, layer.bits)


def cpu_fast_paths(model: nn.Module) -> dict[str, int]:
    """Give `model`'s RoPE modules per-step tables (`TabledRoPE`) and its `nn.RMSNorm`s one
    compiled graph each (`CompiledRMSNorm`), in place. Returns how many of each it replaced."""
    tables: dict[bytes, _Tables] = {}
    done = {"rope": 0, "rms_norm": 0}
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if type(child) is nn.RMSNorm:
                setattr(module, name, CompiledRMSNorm(child))
                done["rms_norm"] += 1
            elif name == "rope" and isinstance(child, nn.Module) and not isinstance(child, TabledRoPE):
                tabled = TabledRoPE.wrap(child, tables)
                if tabled is not None:
                    setattr(module, name, tabled)
                    done["rope"] += 1
    return done


class CompiledRMSNorm(nn.Module):
    """`nn.RMSNorm` as one compiled graph (the same weight, under the same parameter name)."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._eps = mx.array(norm.eps, mx.float32)  # not a parameter (leading underscore)

    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(x, self.weight, self._eps)


@mx.compile
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * normed.astype(x.dtype)).astype(x.dtype)


class _Tables:
    """The cos / sin of one rotation at the positions of the last call, shared by layers."""

    def __init__(self, rope: nn.Module, dims: int, traditional: bool):
        self.rope, self.dims, self.traditional = rope, dims, traditional
        self.last: tuple = (None, None, None)  # ((offset, rows), cos, sin), replaced whole

    def at(self, offset: int, rows: int) -> tuple[mx.array, mx.array]:
        key, cos, sin = self.last
        if key == (offset, rows):
            return cos, sin
        # The module applied to a basis: per pair, (1, 0) rotates to (cos, sin) times any scale
        # the module applies (YaRN's mscale), since a rotation is linear.
        h = self.dims // 2
        if self.traditional:  # pairs (2i, 2i + 1)
            basis = mx.broadcast_to(mx.array([1.0, 0.0]), (1, 1, rows, h, 2))
            out = self.rope(basis.reshape(1, 1, rows, self.dims), offset=offset).reshape(1, 1, rows, h, 2)
            cos, sin = out[..., 0], out[..., 1]
        else:  # pairs (i, i + dims / 2)
            basis = mx.concatenate([mx.ones((1, 1, rows, h)), mx.zeros((1, 1, rows, h))], axis=-1)
            out = self.rope(basis, offset=offset)
            cos, sin = out[..., :h], out[..., h:]
        self.last = ((offset, rows), cos, sin)
        return cos, sin


class TabledRoPE(nn.Module):
    """A RoPE module's rotation from cos / sin tables of the call's positions: the module runs
    once per step on a basis (`_Tables`), then each layer's queries and keys take one compiled
    multiply-add. Calls with a non-int offset or extra arguments go to the module itself."""

    def __init__(self, rope: nn.Module, tables: _Tables):
        super().__init__()
        self.rope = rope
        self._tables = tables

    @classmethod
    def wrap(cls, rope: nn.Module, shared: dict[bytes, _Tables]) -> "TabledRoPE | None":
        """`rope` tabled, its tables shared with any module of `shared` that rotates alike;
        None when `rope` is not a RoPE module of that form or the tables do not reproduce it."""
        dims, traditional = getattr(rope, "dims", None), getattr(rope, "traditional", None)
        if not isinstance(dims, int) or dims < 2 or dims % 2 or not isinstance(traditional, bool):
            return None
        tables = _Tables(rope, dims, traditional)
        try:
            if not _reproduces(rope, cls(rope, tables), dims):
                return None
            fingerprint = _fingerprint(tables)
        except (TypeError, ValueError):  # not called as rope(x, offset=int)
            return None
        return cls(rope, shared.setdefault(fingerprint, tables))

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        if kwargs or not isinstance(offset, int):
            return self.rope(x, offset=offset, **kwargs)
        t = self._tables
        cos, sin = t.at(offset, x.shape[-2])
        return _rotate(t.dims, t.traditional)(x, cos, sin)


@lru_cache(maxsize=None)
def _rotate(dims: int, traditional: bool):
    """x's first `dims` features rotated in pairs by (cos, sin), the rest as they are; compiled
    once per form (and per input shape, as mx.compile keys its graphs)."""

    def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        r = x[..., :dims].astype(mx.float32)
        if traditional:
            r = r.reshape(*r.shape[:-1], dims // 2, 2)
            x1, x2 = r[..., 0], r[..., 1]
            out = mx.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(*x.shape[:-1], dims)
        else:
            x1, x2 = r[..., : dims // 2], r[..., dims // 2 :]
            out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        out = out.astype(x.dtype)
        return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)

    return mx.compile(rotate)


def _reproduces(rope: nn.Module, tabled: TabledRoPE, dims: int) -> bool:
    """Whether `tabled` gives `rope`'s output on random inputs at a few positions (heads of
    dims + 2 features: a partial rotation's untouched tail is checked too)."""
    key = mx.random.key(0)
    for offset, rows in _CHECK_AT:
        x = mx.random.normal((1, 2, rows, dims + 2), key=key)
        want, got = rope(x, offset=offset), tabled(x, offset=offset)
        if want.shape != got.shape or mx.abs(want - got).max().item() > _CHECK_TOLERANCE * (
            1 + mx.abs(want).max().item()
        ):
            return False
    return True


def _fingerprint(tables: _Tables) -> bytes:
    """What tells two rotations apart: the form and the tables at a far position."""
    cos, sin = tables.at(12345, 1)
    mx.eval(cos, sin)
    h = hashlib.sha1(f"{tables.dims}:{tables.traditional}".encode())
    h.update(np.asarray(mx.concatenate([cos, sin], axis=-1).astype(mx.float32)).tobytes())
    return h.digest()
