"""The exact kernel sources MLX compiles for a call, for the CI compile checks (not used at
run time): `metal_source` reproduces ml-explore/mlx `mlx/backend/common/metal_kernel.cpp`
(`write_signature`, `write_template`, `make_template_hash`), compiled in CI through a clang
shim; `cuda_source` reproduces `mlx/backend/cuda/custom_kernel.cpp`'s `build_kernel`,
compiled by nvcc where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .build import CUDA_TYPES, check_op, cuda_parts, cuda_body, cuda_header, kernel_name, render

_METAL_ATTRIBUTES = (  # order and types of mlx metal_kernel.cpp
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_METAL_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}


@dataclass(frozen=True)
class ArgInfo:
    """What MLX's signature depends on for one input: dtype, ndim, size."""

    dtype: mx.Dtype
    ndim: int
    size: int

    @classmethod
    def of(cls, a: mx.array) -> "ArgInfo":
        return cls(a.dtype, a.ndim, a.size)


def _template_value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return _METAL_TYPES[v]


def metal_source(
    op: str,
    inputs: list[ArgInfo],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, object]],
) -> tuple[str, str]:
    """(kernel name, full source) that `mx.fast.metal_kernel` compiles for this call.

    Mirrors mlx/backend/common/metal_kernel.cpp (MLX 0.32): inputs with fewer than
    8 elements go in `constant` space, 0-d inputs are references, attributes are
    found by substring in the body, and template kernels get an explicit
    `[[host_name]]` instantiation. MLX prepends its utils.h at compile time.
    """
    spec = check_op("metal", op)
    header, body = render(op, "metal")
    name = "custom_kernel_" + kernel_name(op)
    template_def = ""
    if template:
        template_def = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        name += "_" + template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for a in inputs:
        name += "_" + _METAL_TYPES[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < 8 else "")
    for d in output_dtypes:
        name += "_" + _METAL_TYPES[d]

    src = header
    if template:
        kinds = [
            "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
            for _, v in template
        ]
        src += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    args = []
    index = 0
    for n, a in zip(spec.inputs, inputs):
        space = "constant" if a.size < 8 else "device"
        ref = "&" if a.ndim == 0 else "*"
        args.append(f"  const {space} {_METAL_TYPES[a.dtype]}{ref} {n} [[buffer({index})]]")
        index += 1
        if a.ndim > 0:
            for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*")):
                if n + suffix in body:
                    args.append(f"  {decl} {n}{suffix} [[buffer({index})]]")
                    index += 1
            if n + "_ndim" in body:
                args.append(f"  const constant int& {n}_ndim [[buffer({index})]]")
                index += 1
    for n, d in zip(spec.outputs, output_dtypes):
        args.append(f"  device {_METAL_TYPES[d]}* {n} [[buffer({index})]]")
        index += 1
    args += [f"  {t} {a} [[{a}]]" for a, t in _METAL_ATTRIBUTES if a in body]
    src += f"[[kernel]] void {name}(\n" + ",\n".join(args) + ") {\n" + body + "\n}\n"
    if template:
        inst = name + template_def
        src += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    return name, src


def cuda_source(op: str, inputs: list[ArgInfo], output_dtypes: list[mx.Dtype], template) -> str:
    """The source `mx.fast.cuda_kernel` compiles for this `launch`, less MLX's own includes
    (mlx/backend/cuda/custom_kernel.cpp `build_kernel`); the kernel files are #included."""
    spec = check_op("cuda", op)
    name = cuda_parts(op)[2]
    header = cuda_header(op, template)
    body = cuda_body(op, template)
    args = []
    for n, a in zip(spec.inputs, inputs):
        args.append(f"    const {CUDA_TYPES[a.dtype]}* {n}")
        if a.ndim > 0:
            for suffix, t in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in body:
                    args.append(f"    const __grid_constant__ {t} {n}{suffix}")
    args += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(spec.outputs, output_dtypes)]
    return (
        header
        + "\nnamespace mlx::core::cu {\n\n"
        + f"__global__ void custom_kernel_{name}(\n"
        + ",\n".join(args)
        + ") {\n"
        + body
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
