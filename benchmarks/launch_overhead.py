"""What one op costs on MLX's GPU backend, split into graph build (Python/C++ before
mx.eval) and evaluation, for ops chained inside one eval (as in a decode step).

Measures tiny ops whose GPU work is negligible, so what is left is launch overhead:
  * a built-in op (x + 1);
  * an mx.fast.cuda_kernel / metal_kernel with a short source, with a ~25 KB header
    (MLX rebuilds and hashes the whole source per call), with init_value (a fill per
    output), with a per-call int32 array made from Python ints (the usual way to pass a
    decode position);
  * on CUDA, mx.fast.precompiled_cuda_kernel (PTX once; scalars as kernel arguments);
and the decode calls of benchmarks/decode_attention.py at a few contexts.
Writes <out>/launch_overhead.json and .md (default: benchmarks/results/).

    python benchmarks/launch_overhead.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turbospark_mlx.gpu.backend import auto_backend
from turbospark_mlx.gpu.decode import tq_decode_attention
from turbospark_mlx.quant.tables import LayerQuant, side_quant


def split_times(fn, x0, n: int = 200, repeats: int = 5) -> dict:
    """Median per-call build and eval microseconds of n chained calls."""
    mx.eval(fn(x0))
    build, run = [], []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        x = x0
        for _ in range(n):
            x = fn(x)
        t1 = time.perf_counter()
        mx.eval(x)
        mx.synchronize()
        t2 = time.perf_counter()
        build.append((t1 - t0) / n * 1e6)
        run.append((t2 - t1) / n * 1e6)
    b, r = statistics.median(build), statistics.median(run)
    return {"build_us": b, "eval_us": r, "total_us": b + r}


# A one-thread `out[0] = inp[0] + scalar` in PTX, for mx.fast.precompiled_cuda_kernel
# (the precompiled_ptx_scalar row of results/launch_overhead.json).
TINY_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry tiny_add(.param .u64 p0, .param .u64 p1, .param .u32 p2)
{
  .reg .pred %p<2>; .reg .f32 %f<4>; .reg .b32 %r<3>; .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [p0]; ld.param.u64 %rd2, [p1]; ld.param.u32 %r1, [p2];
  mov.u32 %r2, %tid.x; setp.ne.s32 %p1, %r2, 0; @%p1 bra DONE;
  cvta.to.global.u64 %rd3, %rd1; cvt.rn.f32.s32 %f1, %r1; ld.global.f32 %f2, [%rd3];
  add.f32 %f3, %f2, %f1; cvta.to.global.u64 %rd4, %rd2; st.global.f32 [%rd4], %f3;
DONE:
  ret;
}
"""


def tiny_ops(backend: str) -> dict:
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    tid = "threadIdx.x" if backend == "cuda" else "thread_position_in_grid.x"
    src = f"if ({tid} == 0) out[0] = inp[0] + 1.0f;"
    big_header = "".join(
        f"// padding line {i:05d} of a header about as long as the decode kernel's\n" for i in range(360)
    )
    k_small = make(name="tiny", input_names=["inp"], output_names=["out"], source=src)
    k_big = make(name="tiny_big", input_names=["inp"], output_names=["out"], source=src, header=big_header)
    k_prm = make(name="tiny_prm", input_names=["inp", "prm"], output_names=["out"], source=src)
    k_3out = make(name="tiny3", input_names=["inp"], output_names=["out", "o2", "o3"], source=src)
    call = {
        "grid": (32, 1, 1),
        "threadgroup": (32, 1, 1),
        "output_shapes": [(1,)],
        "output_dtypes": [mx.float32],
    }
    x0 = mx.zeros((1,), mx.float32)
    res = {
        "builtin_add": split_times(lambda x: x + 1, x0),
        "kernel_small_source": split_times(lambda x: k_small(inputs=[x], **call)[0], x0),
        "kernel_25kb_header": split_times(lambda x: k_big(inputs=[x], **call)[0], x0),
        "kernel_small_init_value": split_times(lambda x: k_small(inputs=[x], init_value=0, **call)[0], x0),
        "kernel_3_outputs_init_value": split_times(
            lambda x: k_3out(
                inputs=[x],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(1,), (4096,), (8,)],
                output_dtypes=[mx.float32, mx.float32, mx.uint32],
                init_value=0,
            )[0],
            x0,
        ),
        "kernel_fresh_int_array": split_times(
            lambda x: k_prm(inputs=[x, mx.array([5, 0], dtype=mx.int32)], **call)[0], x0
        ),
    }
    cached = mx.array([5, 0], dtype=mx.int32)
    res["kernel_cached_int_array"] = split_times(lambda x: k_prm(inputs=[x, cached], **call)[0], x0)
    if backend == "cuda":
        try:
            ptx = TINY_PTX.encode()
            res["precompiled_ptx_scalar"] = split_times(
                lambda x: mx.fast.precompiled_cuda_kernel(
                    name="tiny_add",
                    compiled_source=ptx,
                    inputs=[x],
                    output_shapes=[(1,)],
                    output_dtypes=[mx.float32],
                    scalars=[1],
                    grid=(32, 1, 1),
                    threadgroup=(32, 1, 1),
                )[0],
                x0,
            )
        except Exception as e:  # report, do not hide
            res["precompiled_ptx_scalar"] = {"error": str(e)[:300]}
    return res


def decode_row(L: int, backend: str, Hq: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    """FP16 SDPA and tq4 decode (each variant) at context L, llama shape."""
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    k = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
    v = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
    quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
    kc = mx.random.randint(0, 1 << 16, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
    vc = mx.random.randint(0, 1 << 16, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    mx.eval(q0, k, v, kc, vc, kn, vn)
    row = {
        "fp16_sdpa": split_times(
            lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5), q0, 50
        )
    }
    for variant in ("auto", "mma", "dialect") if backend == "cuda" else ("auto",):
        row[f"tq4_{variant}"] = split_times(
            lambda q, variant=variant: tq_decode_attention(
                q, kc, kn, vc, vn, quant, scale=D**-0.5, position=L - 1, backend=backend, variant=variant
            ),
            q0,
            50,
        )
    return row


def device() -> str:
    """The GPU's name, memory and driver (nvidia-smi), else the platform."""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except FileNotFoundError:
        smi = ""
    return smi or platform.platform()


def markdown(res: dict) -> str:
    """The results as tables: tiny ops, then the decode calls."""
    lines = [
        "# Launch overhead of MLX ops",
        "",
        f"Machine: {res.get('device', '?')}; MLX {res['mlx']}; backend {res['backend']}; "
        f"{res.get('date', '?')}.",
        f"Command: `{res.get('command', 'python benchmarks/launch_overhead.py')}`"
        + (f"; code: {res['code']}." if res.get("code") else ""),
        "",
        "Per call, median of 5 runs of N calls chained in one `mx.eval` (N = 200 tiny ops, 50 decode calls): "
        "build = graph building in Python / C++ before `mx.eval`, eval = `mx.eval` until the GPU is done.",
        "",
        "## Tiny ops (GPU work negligible)",
        "",
        "| op | build us | eval us | total us |",
        "|---|---|---|---|",
    ]
    for name, r in res["tiny"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | |")
        else:
            lines.append(f"| {name} | {r['build_us']:.1f} | {r['eval_us']:.1f} | {r['total_us']:.1f} |")
    lines += [
        "",
        "## Decode calls (llama shape: B 1, Hq 32, Hkv 8, D 128; tq4)",
        "",
        "`tq4_auto` is the automatic choice of `tq_decode_attention`, `tq4_mma` / `tq4_dialect` "
        "each kernel forced.",
        "",
        "| context | method | build us | eval us | total us |",
        "|---|---|---|---|---|",
    ]
    for ctx, row in res["decode"].items():
        for name, r in row.items():
            lines.append(
                f"| {ctx} | {name} | {r['build_us']:.1f} | {r['eval_us']:.1f} | {r['total_us']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=None, help="directory for launch_overhead.{json,md} (default: benchmarks/results)"
    )
    ap.add_argument("--contexts", default="4096,32768,131072")
    args = ap.parse_args()
    backend = auto_backend()
    if backend not in ("cuda", "metal"):
        sys.exit(f"needs a GPU backend of MLX (this build gives {backend!r})")
    out = {
        "backend": backend,
        "mlx": mx.__version__,
        "device": device(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + " ".join(sys.argv),
        "tiny": tiny_ops(backend),
    }
    out["decode"] = {c: decode_row(int(c), backend) for c in args.contexts.split(",")}
    text = json.dumps(out, indent=1)
    print(text)
    dest = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "launch_overhead.json").write_text(text + "\n")
    (dest / "launch_overhead.md").write_text(markdown(out))


if __name__ == "__main__":
    main()
