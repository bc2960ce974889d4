"""Build the GPU kernels from their one dialect source, once per backend.

Each op has one body in `kernels/<op>.kernel`, written in a small dialect:
`TS_*` macros and `ts_*` helpers come from the backend prelude
(`prelude_metal.h` / `prelude_cuda.h`) plus `tq_common.h`; thread and group
indices are tokens this module substitutes *textually*, because MLX builds a
Metal kernel's signature by scanning the body text for attribute names
(`thread_position_in_threadgroup`, ...), so hiding them in a header macro would
break the Metal build.

Kernel objects are built lazily (constructing a CUDA kernel without the CUDA
backend raises) and cached here, never on a cache instance: caches get deep-copied.
MLX compiles one library per template instantiation. On CUDA the source handed to
MLX #includes the kernel files by path and carries the template values as constants
(`cuda_kernel`): MLX rebuilds and hashes that text on every call.

The exact sources MLX compiles, for the CI compile checks, are rendered by `inspect.py`.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from .sources import kernel_source, kernels_dir

GPU_BACKENDS = ("metal", "cuda")

# Custom-kernel calls by op since import (graph nodes built, not GPU executions): what
# benchmarks/generate_e2e.py reports as launches per decode step. Reset it freely.
LAUNCHES: Counter = Counter()

# Dialect tokens -> backend text (1-D threadgroups; SIMD width 32 on both).
DIALECT: dict[str, dict[str, str]] = {
    "metal": {
        "TS_TID": "thread_position_in_threadgroup.x",
        "TS_GROUP_X": "threadgroup_position_in_grid.x",
        "TS_GROUP_Y": "threadgroup_position_in_grid.y",
        "TS_LANE": "thread_index_in_simdgroup",
        "TS_NGROUPS_X": "threadgroups_per_grid.x",
    },
    "cuda": {
        "TS_TID": "threadIdx.x",
        "TS_GROUP_X": "blockIdx.x",
        "TS_GROUP_Y": "blockIdx.y",
        "TS_LANE": "(threadIdx.x & 31u)",
        "TS_NGROUPS_X": "gridDim.x",
    },
}


@dataclass(frozen=True)
class KernelSpec:
    """One op: its body file, argument names (order = call order), the backends it is
    written for and any headers of its own (after the prelude and tq_common.h)."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    backends: tuple[str, ...] = GPU_BACKENDS
    headers: tuple[str, ...] = ()
    # CUDA: the template constant whose value times 32 is the block size, given to ptxas as
    # __launch_bounds__ (see _cuda_launch_bounds); None: no bound.
    warps_constant: str | None = None


SPECS: dict[str, KernelSpec] = {
    s.op: s
    for s in (
        KernelSpec("tq_quantize", ("x", "rot", "bnd"), ("codes", "norms")),
        KernelSpec(
            "tq_commit",
            ("k_ring", "v_ring", "first", "count", "k_mean", "k_rot", "k_bnd", "v_rot", "v_bnd"),
            ("k_codes", "k_norms", "v_codes", "v_norms"),
        ),
        KernelSpec("tq_dequantize", ("codes", "norms", "count", "cent", "rot", "mean"), ("out",)),
        KernelSpec(
            "tq_decode_attention",
            (
                "q",
                "k_codes",
                "k_norms",
                "v_codes",
                "v_norms",
                "k_cent",
                "v_cent",
                "k_rot",
                "qpos",
                "kv0",
                "kv_starts",
            ),
            ("part_o", "part_ms"),
        ),
        KernelSpec("tq_decode_reduce", ("part_o", "part_ms", "sinks", "v_rot"), ("out",)),
        # Tensor-core decode (mma.sync), one launch: NVIDIA only.
        KernelSpec(
            "tq_decode_mma",
            (
                "q",
                "k_bytes",
                "k_norms",
                "v_bytes",
                "v_norms",
                "tables",
                "sinks",
                "k_sinks",
                "v_sinks",
                "k_recent",
                "v_recent",
                "k_mean",
                "qpos",
                "kv0",
                "kv_starts",
                "scratch",
                "after",
            ),
            ("out",),
            backends=("cuda",),
            headers=("tq_mma_cuda.h", "tq_fp16_rows.h"),
            warps_constant="NWARP",
        ),
    )
}


def check_op(backend: str, op: str) -> KernelSpec:
    if backend not in GPU_BACKENDS:
        raise ValueError(f"no kernel backend {backend!r}; kernel backends: {', '.join(GPU_BACKENDS)}")
    if op not in SPECS:
        raise ValueError(f"no kernel {op!r}; kernels: {', '.join(SPECS)}")
    if backend not in SPECS[op].backends:
        raise ValueError(
            f"kernel {op!r} is written for {', '.join(SPECS[op].backends)} only, not {backend!r}"
        )
    return SPECS[op]


def ops_for(backend: str) -> list[str]:
    """The ops written for `backend`."""
    return [op for op, spec in SPECS.items() if backend in spec.backends]


def render(op: str, backend: str) -> tuple[str, str]:
    """(header, body) of `op` for `backend`: prelude + shared helpers, and the body with tokens substituted."""
    spec = check_op(backend, op)
    header = "\n".join(kernel_source(n) for n in (f"prelude_{backend}.h", "tq_common.h", *spec.headers))
    table = DIALECT[backend]
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, table)) + r")\b")
    body = pattern.sub(lambda m: table[m.group(1)], kernel_source(f"{op}.kernel"))
    return _strip_comments(header), _strip_comments(body)


def _strip_comments(src: str) -> str:
    """`src` without // comments and blank lines. MLX rebuilds and hashes the whole kernel
    source on every call (~0.3 us per KB on MLX CUDA, benchmarks/launch_overhead.py), and
    the comments are half of it. Lines holding a string literal are kept whole."""
    out = []
    for line in src.splitlines():
        if '"' not in line and "//" in line:
            line = line[: line.index("//")]
        if line.strip():
            out.append(line.rstrip())
    return "\n".join(out) + "\n"


def kernel_name(op: str) -> str:
    """MLX kernel name: unique per distinct source (MLX keys libraries by name + source hash)."""
    return f"turbospark_{op}"


@lru_cache(maxsize=None)
def metal_kernel(op: str):
    """The MLX Metal kernel object of `op`, built once per process; template values are
    call arguments."""
    spec = check_op("metal", op)
    header, body = render(op, "metal")
    return mx.fast.metal_kernel(
        name=kernel_name(op),
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=body,
        header=header,
    )


def launch(op: str, backend: str, template, shared_memory: int = 0, **call) -> list[mx.array]:
    """Call kernel `op` on `backend` with these template values; `call` is the rest of
    MLX's kernel call (inputs, grid, threadgroup, output_shapes, output_dtypes, ...)."""
    LAUNCHES[op] += 1
    if backend == "cuda":
        return cuda_kernel(op, tuple(template), shared_memory)(**call)
    check_op(backend, op)
    return metal_kernel(op)(template=template, **call)


# -- CUDA: a short source that #includes the kernel files ---------------------
# MLX CUDA rebuilds a custom kernel's whole source string on every call and hashes it on
# every eval (mlx/backend/cuda/custom_kernel.cpp), ~0.3 us per KB (benchmarks/
# launch_overhead.py). NVRTC reads #include'd files from disk, so the source MLX carries
# is a few hundred bytes whatever the kernel's size; template values are constants in
# it (one kernel object per template), so a call converts no template list either.


def _include_path(name: str) -> str:
    kernel_source(name)  # a clear error if the file is missing
    path = (kernels_dir() / name).resolve().as_posix()
    if '"' in path or "\n" in path:
        raise RuntimeError(f"kernel source path {path!r} cannot be #included (quote or newline in it)")
    return path


@lru_cache(maxsize=None)
def cuda_parts(op: str) -> tuple[str, str, str]:
    """(header, body tail, kernel name) of `op` on CUDA: the dialect tokens as macros and
    the prelude and headers by #include; the body by #include, after a reference to each
    input shape it reads (MLX passes `<input>_shape` only if the source text names it).
    The name carries a digest of the files, as MLX caches modules by name + source text."""
    spec = check_op("cuda", op)
    files = ("prelude_cuda.h", "tq_common.h", *spec.headers, f"{op}.kernel")
    macros = "".join(f"#define {k} {v}\n" for k, v in DIALECT["cuda"].items())
    header = macros + "".join(f'#include "{_include_path(f)}"\n' for f in files[:-1])
    text = kernel_source(files[-1])
    refs = "".join(
        f"(void){n}{suffix};\n"
        for n in spec.inputs
        for suffix in ("_shape", "_strides", "_ndim")
        if n + suffix in text
    )
    digest = hashlib.sha1("\0".join(kernel_source(f) for f in files).encode()).hexdigest()[:12]
    return header, refs + f'#include "{_include_path(files[-1])}"\n', f"{kernel_name(op)}_{digest}"


def _cuda_constants(template) -> str:
    out = ""
    for n, v in template:
        if isinstance(v, bool):
            out += f"constexpr bool {n} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            out += f"constexpr int {n} = {v};\n"
        else:
            out += f"using {n} = {CUDA_TYPES[v]};\n"
    return out


def _cuda_launch_bounds(op: str, template) -> str:
    """Header lines that give the kernel of this build `__launch_bounds__(block size, 1)`, so
    that ptxas fits its registers to the block (65536 / threads each): unbounded, NVRTC on
    the H200 gave a 16-warp tq_decode_mma more than 128 and its launch failed ("too many
    resources requested for launch"). MLX writes the kernel's signature after the header,
    so redefining `__global__` there is the one way to reach it."""
    spec = SPECS[op]
    if spec.warps_constant is None:
        return ""
    threads = 32 * dict(template)[spec.warps_constant]
    return f"#undef __global__\n#define __global__ __attribute__((global)) __launch_bounds__({threads}, 1)\n"


def cuda_header(op: str, template) -> str:
    """The `header` given to mx.fast.cuda_kernel for `op` at these template values."""
    return cuda_parts(op)[0] + _cuda_launch_bounds(op, template)


def cuda_body(op: str, template) -> str:
    """The `source` given to mx.fast.cuda_kernel for `op` at these template values."""
    return _cuda_constants(template) + cuda_parts(op)[1]


@lru_cache(maxsize=None)
def cuda_kernel(op: str, template: tuple, shared_memory: int = 0):
    """The MLX CUDA kernel object of `op` at these template values (a tuple of
    (name, value)), built once per process."""
    spec = check_op("cuda", op)
    name = cuda_parts(op)[2]
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=cuda_body(op, template),
        header=cuda_header(op, template),
        shared_memory=shared_memory,
    )


CUDA_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint32: "uint32_t",
    mx.int32: "int32_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
