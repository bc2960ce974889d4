"""CPU checks of the kernel dialect and the Metal compile check (no GPU needed).

The Metal check compiles the exact source MLX's `metal_kernel` would build for
every kernel variant the package can launch (generated signature + body + the
explicit template instantiation) with clang against tests/metal_shim, so a Metal
syntax or type error fails CI. CI (.ci/run) installs clang and sets
TURBOSPARK_METAL_CHECK=1, which turns a missing clang into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import pytest

from turbospark_mlx.gpu import build, sources
from turbospark_mlx.gpu.args import length_arg, rotation_arg
from turbospark_mlx.gpu.build import cuda_body, render
from turbospark_mlx.gpu.decode import decode_plan
from turbospark_mlx.gpu.decode_mma import mma_plan
from turbospark_mlx.gpu.inspect import ArgInfo, cuda_source, metal_source
from turbospark_mlx.quant.tables import LayerQuant, side_quant

SHIM = Path(__file__).resolve().parent / "metal_shim"
CUDA_SHIM = Path(__file__).resolve().parent / "cuda_shim" / "cuda_shim.h"
BITS = (1, 2, 3, 4, 8)
HEAD_DIMS = (64, 96, 128, 256, 512)


def _clang() -> str:
    for name in ("clang", "clang-14", "clang-15", "clang-16"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("TURBOSPARK_METAL_CHECK"):
        pytest.fail("the Metal compile check needs clang (apt-get install clang)")
    pytest.skip("the Metal compile check needs clang (apt-get install clang)")


def _quant(kb: int, vb: int, d: int) -> LayerQuant:
    rot = "auto"
    return LayerQuant(0, side_quant(kb, d, rot, 0, 0, "k"), side_quant(vb, d, rot, 0, 0, "v"))


def _rot_info(side) -> tuple[int, ArgInfo]:
    kind, arr = rotation_arg(side)
    return kind, ArgInfo(mx.float32, arr.ndim, arr.size)


@lru_cache(maxsize=None)
def _variants() -> dict[str, list[tuple[list[ArgInfo], list, list]]]:
    """(inputs, output dtypes, template) of every launch shape the package makes, per op."""
    f32, u32, i32 = mx.float32, mx.uint32, mx.int32
    out: dict[str, list] = {
        "tq_quantize": [], "tq_commit": [], "tq_dequantize": [], "tq_decode_attention": [], "tq_decode_reduce": []
    }
    for d in HEAD_DIMS:
        for bits in BITS:
            side = side_quant(bits, d, "auto", 0, 0, "k")
            kind, rot = _rot_info(side)
            for dt in (mx.float16, mx.bfloat16, mx.float32):
                out["tq_quantize"].append(
                    (
                        [ArgInfo(dt, 2, 4 * d), rot, ArgInfo(f32, 1, max(8, 2**bits - 1))],
                        [u32, f32],
                        [("T", dt), ("D", d), ("BITS", bits), ("W", side.words), ("ROT", kind)],
                    )
                )
            for dt, has_mean in ((mx.float16, False), (mx.bfloat16, True), (mx.float32, True)):
                mean = ArgInfo(f32, 2, 8 * d) if has_mean else ArgInfo(f32, 1, 8)
                out["tq_dequantize"].append(
                    (
                        [ArgInfo(u32, 3, 8 * 64 * side.words), ArgInfo(f32, 2, 8 * 64),
                         ArgInfo(mx.uint8, 1, 50), ArgInfo(f32, 1, max(8, 2**bits)), rot, mean],
                        [dt],
                        [("OT", dt), ("D", d), ("BITS", bits), ("W", side.words), ("ROT", kind),
                         ("HAS_MEAN", has_mean), ("NR", 8)],
                    )
                )
    for d in HEAD_DIMS:
        for kb, vb in ((4, 4), (8, 4), (3, 3), (2, 8), (1, 2)):
            q = _quant(kb, vb, d)
            (kkind, krot), (vkind, vrot) = _rot_info(q.k), _rot_info(q.v)
            for dt, center in ((mx.float16, True), (mx.bfloat16, False)):
                out["tq_commit"].append(
                    (
                        [ArgInfo(dt, 3, 8 * 640 * d), ArgInfo(dt, 3, 8 * 640 * d), ArgInfo(mx.uint8, 1, 300),
                         ArgInfo(mx.uint8, 1, 2), ArgInfo(f32, 2, 8 * d) if center else ArgInfo(f32, 1, 8),
                         krot, ArgInfo(f32, 1, max(8, 2**kb - 1)), vrot, ArgInfo(f32, 1, max(8, 2**vb - 1))],
                        [u32, f32, u32, f32],
                        [("T", dt), ("D", d), ("KB", kb), ("KW", q.k.words), ("KROT", kkind), ("VB", vb),
                         ("VW", q.v.words), ("VROT", vkind), ("RCAP", 640), ("CENTER", center)],
                    )
                )
    seen = set()
    for d in HEAD_DIMS:
        for kb in BITS:
            for vb in BITS:
                q = _quant(kb, vb, d)
                for g, m in ((1, 1), (4, 1), (8, 1), (4, 3), (2, 5)):
                    for end in (100, 1 << 17):
                        cb = 64 if m > 1 and end > 1000 else 1  # a protected layer's commit blocks
                        plan = decode_plan(
                            q, g, m, d, 8, end, scale=d**-0.5, has_starts=end < 1000, commit_rows=cb
                        )
                        if plan is None:
                            continue
                        key = tuple(v for _, v in plan["template"])
                        if key in seen:
                            continue
                        seen.add(key)
                        cap = 4096
                        for qdt in (mx.float16, mx.bfloat16, mx.float32):
                            ins = [
                                ArgInfo(qdt, 4, 8 * g * m * d),
                                ArgInfo(u32, 4, 8 * cap * q.k.words),
                                ArgInfo(f32, 3, 8 * cap),
                                ArgInfo(u32, 4, 8 * cap * q.v.words),
                                ArgInfo(f32, 3, 8 * cap),
                                ArgInfo(f32, 1, max(8, 2**kb)),
                                ArgInfo(f32, 1, max(8, 2**vb)),
                                _rot_info(q.k)[1],
                                ArgInfo(mx.uint8, 1, 5000),
                                ArgInfo(mx.uint8, 1, 1),
                                ArgInfo(i32, 1, 8),
                            ]
                            out["tq_decode_attention"].append((ins, [f32, f32], plan["template"]))
                            R, RP = plan["R"], plan["RP"]
                            vkind, vrot = _rot_info(q.v)
                            for sink in (False, True):
                                out["tq_decode_reduce"].append(
                                    (
                                        [
                                            ArgInfo(f32, 5, 64 * R * d),
                                            ArgInfo(f32, 5, 64 * RP * 2),
                                            ArgInfo(f32, 1, 8),
                                            vrot,
                                        ],
                                        [qdt],
                                        [
                                            ("D", d),
                                            ("G", g),
                                            ("M", m),
                                            ("R", R),
                                            ("RP", RP),
                                            ("TSL", max(1, min(8, 1024 // d))),
                                            ("HAS_SINK", sink),
                                            ("VROT", vkind),
                                            ("OT", qdt),
                                        ],
                                    )
                                )
    return out


def _translation_unit(op: str, variants) -> str:
    """All variants of one op in one translation unit: the header once, each kernel after it."""
    header, _ = render(op, "metal")
    parts = []
    names = set()
    for ins, outs, template in variants:
        name, src = metal_source(op, ins, outs, template)
        if name in names:
            continue
        names.add(name)
        assert src.startswith(header)
        parts.append(src[len(header) :])
    # Attributes on an explicit instantiation are Metal-only: strip them for clang.
    body = re.sub(r"template \[\[host_name\(\"[^\"]*\"\)\]\] \[\[kernel\]\] ", "template ", "\n".join(parts))
    return header + "\n" + body


def _compile(source: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.metal.cpp"
    path.write_text(source)
    return subprocess.run(
        [
            _clang(),
            "-x",
            "c++",
            "-std=c++17",
            "-fsyntax-only",
            "-Wno-unknown-attributes",
            "-ferror-limit=5",
            f"-I{SHIM}",
            str(path),
        ],
        capture_output=True,
        text=True,
    )


def test_dialect_tokens_substituted_textually():
    for op in build.ops_for("metal"):
        for backend in ("metal", "cuda"):
            header, body = render(op, backend)
            assert not re.search(r"\bTS_(TID|GROUP_X|GROUP_Y|LANE)\b", body), (op, backend)
            assert "TS_SHARED" in header and "ts_simd_sum" in header
        # MLX finds Metal attributes by scanning the body, so they must be there literally.
        _, metal_body = render(op, "metal")
        assert "thread_position_in_threadgroup" in metal_body
        _, cuda_body = render(op, "cuda")
        assert "threadIdx.x" in cuda_body and "thread_position" not in cuda_body
        # What CUDA launches: the files #included, the tokens as macros before them.
        cuda_header = build.cuda_parts(op)[0]
        for token, text in build.DIALECT["cuda"].items():
            assert f"#define {token} {text}\n" in cuda_header


def test_metal_source_matches_mlx_signature_rules():
    ins = [ArgInfo(mx.float16, 2, 512), ArgInfo(mx.float32, 1, 128), ArgInfo(mx.float32, 1, 3)]
    name, src = metal_source("tq_quantize", ins, [mx.uint32, mx.float32], [("T", mx.float16), ("D", 128)])
    assert name == "custom_kernel_turbospark_tq_quantize__float16_t_128_float16_t_float_floatc_uint32_t_float"
    assert "template <typename T, int D>" in src
    assert "const device float16_t* x [[buffer(0)]]" in src
    assert "const constant float* bnd [[buffer(2)]]" in src  # < 8 elements: constant space
    assert "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]" in src
    assert f"decltype({name}<float16_t, 128>) {name}<float16_t, 128>;" in src


def test_cuda_only_kernel_refuses_metal():
    assert "tq_decode_mma" not in build.ops_for("metal")
    with pytest.raises(ValueError, match="cuda only"):
        render("tq_decode_mma", "metal")


@pytest.mark.parametrize("op", sorted(build.ops_for("metal")))
def test_metal_kernels_compile_through_shim(op, tmp_path):
    variants = _variants()[op]
    assert variants
    result = _compile(_translation_unit(op, variants), tmp_path, op)
    assert result.returncode == 0, result.stderr[-4000:]


def test_metal_check_fails_on_planted_error(tmp_path, monkeypatch):
    original = sources.kernel_source.__wrapped__

    def planted(name: str) -> str:
        text = original(name)
        if name == "tq_decode_reduce.kernel":
            text = text.replace("float den =", "flaot den =")  # a one-letter typo
        return text

    monkeypatch.setattr(build, "kernel_source", planted)
    result = _compile(
        _translation_unit("tq_decode_reduce", _variants()["tq_decode_reduce"][:2]), tmp_path, "bad"
    )
    assert result.returncode != 0
    assert "flaot" in result.stderr


@pytest.mark.parametrize("op", sorted(build.ops_for("metal")))
def test_cuda_kernels_typecheck_through_shim(op, tmp_path):
    """The CUDA text of a sample of variants type-checks on the CPU (NVRTC compiles it on the GPU)."""
    variants = _variants()[op]
    sample = variants[:: max(1, len(variants) // 8)]
    for i, (ins, outs, template) in enumerate(sample):
        path = tmp_path / f"{op}_{i}.cu.cpp"
        path.write_text(cuda_source(op, ins, outs, template))
        result = subprocess.run(
            [
                _clang(),
                "-x",
                "c++",
                "-std=c++17",
                "-fsyntax-only",
                "-ferror-limit=5",
                "-include",
                str(CUDA_SHIM),
                str(path),
            ],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, (template, result.stderr[-4000:])


# (K bits, V bits, head_dim, query heads per KV head, query rows): every bit width and head_dim
# on each side, shared and separate tables, 1 to 16 score rows (one and two 8-row blocks).
MMA_SAMPLE = (
    (4, 4, 128, 4, 1),
    (3, 3, 128, 4, 1),
    (8, 4, 128, 4, 1),
    (2, 2, 64, 8, 1),
    (4, 3, 256, 4, 1),
    (8, 8, 64, 1, 1),
    (3, 2, 64, 16, 1),
    (2, 8, 256, 4, 3),
    (4, 4, 128, 16, 1),
    (8, 3, 256, 8, 1),
)


def _mma_plan_of(kb: int, vb: int, d: int, g: int, m: int, **kw) -> dict:
    return mma_plan(_quant(kb, vb, d), g, m, d, 8, 5000, scale=d**-0.5, **{
        "has_starts": False, "has_sink": False, "out_dtype": mx.float16, **kw})


def _mma_unit(i: int, kb: int, vb: int, d: int, g: int, m: int) -> str:
    """The source MLX's cuda_kernel builds for one tq_decode_mma launch (MLX's own header
    replaced by tests/cuda_shim/mlx_device.cuh)."""
    f32, u32, i32 = mx.float32, mx.uint32, mx.int32
    qdt = (mx.float16, mx.bfloat16, mx.float32)[i % 3]
    q = _quant(kb, vb, d)
    # Every third a protected layer's: FP16 rows (4 sink rows, a 128-row window, a ring of
    # 128 + 63 + 16 slots in the cache's dtype, a key mean in every other one), commit blocks of 64.
    dense = (4, 128, 207, i % 2 == 1) if i % 3 == 1 else None
    rdt = (mx.float16, mx.bfloat16)[i % 2]
    plan = _mma_plan_of(
        kb, vb, d, g, m, has_starts=i % 4 == 3, has_sink=i % 2 == 0, out_dtype=qdt, dense=dense,
        commit_rows=64 if dense else 1,
    )
    ins = [
        ArgInfo(qdt, 4, 8 * g * m * d),
        ArgInfo(mx.uint8, 4, 8 * 4096 * 4 * q.k.words),  # the codes' words as bytes
        ArgInfo(f32, 3, 8 * 4096),
        ArgInfo(mx.uint8, 4, 8 * 4096 * 4 * q.v.words),
        ArgInfo(f32, 3, 8 * 4096),
        *[ArgInfo(a.dtype, a.ndim, a.size) for a in plan["tables"]],
        ArgInfo(f32, 1, 8),
        *(
            [ArgInfo(rdt, 4, 8 * 4 * d)] * 2 + [ArgInfo(rdt, 4, 8 * 207 * d)] * 2
            + [ArgInfo(f32, 3, 8 * d) if dense[3] else ArgInfo(f32, 1, 8)]
            if dense else [ArgInfo(f32, 1, 8)] * 5
        ),  # k_sinks, v_sinks, k_recent, v_recent, k_mean
        ArgInfo(mx.uint8, 1, 5000),
        ArgInfo(mx.uint8, 1, 1),
        ArgInfo(i32, 1, 8),
        ArgInfo(u32, 1, 1 << 17),  # scratch
        ArgInfo(qdt, 4, 8 * g * m * d),  # after: the previous launch's output
    ]
    return '#include "mlx_device.cuh"\n' + cuda_source("tq_decode_mma", ins, [qdt], plan["template"])


def test_cuda_mma_kernel_compiles_with_nvcc(tmp_path):
    """The tensor-core kernel (inline PTX: mma.sync, movmatrix) compiled for sm_90a by nvcc, as
    NVRTC compiles it on the GPU (the CPU shim cannot check PTX). At the benchmark's llama
    shape (tq4, D 128, 4 query heads per KV head; 16 warps, 128 registers) ptxas may spill at
    most five words: values live across the main loop, stored once in the set-up and loaded
    after the loop, once per tile of the loop over a warp's last tiles, or (one of them, as the
    first tiles are issued after q') once per round of the main loop: 20 bytes in the SASS. A
    main loop that does not fit its registers shows as more."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc (the CUDA toolkit) to compile the CUDA-only kernel")

    def compile_one(i):
        path = tmp_path / f"mma_{i}.cu"
        path.write_text(_mma_unit(i, *MMA_SAMPLE[i]))
        cmd = [nvcc, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / f"mma_{i}.cubin"), "-Xptxas", "-v"]
        cmd += ["-expt-relaxed-constexpr", f"-I{CUDA_SHIM.parent}", str(path)]
        return subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, range(len(MMA_SAMPLE))))
    for i, (sample, r) in enumerate(zip(MMA_SAMPLE, results)):
        assert r.returncode == 0, (sample, r.stderr[-4000:])
        # The build states its block size (__launch_bounds__), so ptxas fits the registers
        # of all its warps in the SM's 64K: a launch asking for more fails.
        nwarp = dict(_mma_plan_of(*sample)["template"])["NWARP"]
        assert f"__launch_bounds__({32 * nwarp}, 1)" in _mma_unit(i, *sample)
        regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
        assert regs * 32 * nwarp <= 65536, (sample, regs, nwarp)
    spilled = int(re.search(r"(\d+) bytes spill stores", results[0].stderr).group(1))
    assert spilled <= 20, results[0].stderr[-2000:]


def test_per_step_integers_travel_as_array_lengths():
    """Position and kv_start reach the decode kernels as `<input>_shape[0] - 1` of a prefix
    view (a launch parameter; no host-made array in MLX CUDA's managed memory): the view's
    length carries the value, the kernels' bodies read it, and one step's layers share it."""
    for n in (0, 7, 4095, 300_000):  # the last one outgrows the initial buffer
        a = length_arg(n)
        assert a.shape == (n + 1,) and a.dtype == mx.uint8
        assert length_arg(n) is a
    for op in ("tq_decode_attention", "tq_decode_mma"):
        variant = _variants()[op][0] if op == "tq_decode_attention" else None
        template = (
            variant[2]
            if variant
            else mma_plan(
                _quant(4, 4, 128),
                4,
                1,
                128,
                8,
                5000,
                scale=128**-0.5,
                has_starts=False,
                has_sink=False,
                out_dtype=mx.float16,
            )["template"]
        )
        body = cuda_body(op, template)
        assert "(void)qpos_shape;" in body and "(void)kv0_shape;" in body
