# Session 12: where the Python build of one chained 128k call goes (build only, no eval:
# each variant builds 2000 graph nodes, median of 5), and chained build + eval of the
# benchmark's path against FP16 SDPA. Variants of the direct kernel call (precomputed inputs):
# all 14 inputs and 2 outputs; 11 inputs (the four tables as one); 1 output; both.
# Writes $OUT/host_s12.json.
import json, os, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import build_only, random_layer, st  # noqa: E402
import turbospark_mlx.tq_kernels as tk
import turbospark_mlx.kernel_build as kb
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

D, Hq, Hkv, L = 128, 32, 8, 131072
res = {}


quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
q0, kc, kn, vc, vn, k, v = random_layer(quant, L)
scale = D**-0.5
sdpa = lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
bench = lambda q: tk.tq_decode_attention(q, kc, kn, vc, vn, quant, scale=scale, position=L - 1, backend="cuda")
launch = tk._mma_launch(quant, q0, Hkv, scale, False, False)
grid, shapes = launch.shape(-(-L // 16))
spec = kb._check("cuda", "tq_decode_mma")
consts = [*launch.tables, tk._sinks_arg(None), *tk._step_args(L - 1, 0, 1)]
ticket = tk._ticket_arg(Hkv)
cfg = launch.cfg
names = list(spec.inputs)
k14 = launch.kernel
k11 = mx.fast.cuda_kernel(name="x11", input_names=names[:5] + ["tabs"] + names[9:], output_names=list(spec.outputs),
                          source=kb.cuda_body("tq_decode_mma", cfg.template), header=kb.cuda_header("tq_decode_mma", cfg.template),
                          shared_memory=cfg.smem)
k14o1 = mx.fast.cuda_kernel(name="x14o1", input_names=names, output_names=list(spec.outputs)[:1],
                            source=kb.cuda_body("tq_decode_mma", cfg.template), header=kb.cuda_header("tq_decode_mma", cfg.template),
                            shared_memory=cfg.smem)
k11o1 = mx.fast.cuda_kernel(name="x11o1", input_names=names[:5] + ["tabs"] + names[9:], output_names=list(spec.outputs)[:1],
                            source=kb.cuda_body("tq_decode_mma", cfg.template), header=kb.cuda_header("tq_decode_mma", cfg.template),
                            shared_memory=cfg.smem)
tg, dts = launch.threadgroup, launch.output_dtypes
direct = {
    "direct_14in_2out": lambda q: k14(inputs=[q, kc, kn, vc, vn, *consts, ticket], grid=grid, threadgroup=tg,
                                      output_shapes=shapes, output_dtypes=dts)[0],
    "direct_11in_2out": lambda q: k11(inputs=[q, kc, kn, vc, vn, *consts[3:], ticket], grid=grid, threadgroup=tg,
                                      output_shapes=shapes, output_dtypes=dts)[0],
    "direct_14in_1out": lambda q: k14o1(inputs=[q, kc, kn, vc, vn, *consts, ticket], grid=grid, threadgroup=tg,
                                        output_shapes=shapes[:1], output_dtypes=dts[:1])[0],
    "direct_11in_1out": lambda q: k11o1(inputs=[q, kc, kn, vc, vn, *consts[3:], ticket], grid=grid, threadgroup=tg,
                                        output_shapes=shapes[:1], output_dtypes=dts[:1])[0],
}
for rnd in range(3):
    for name, fn in [("sdpa", sdpa), ("bench_path", bench), *direct.items()]:
        res.setdefault(name, {}).setdefault("build_only", []).append(build_only(fn, q0))
    for name, fn in [("sdpa", sdpa), ("bench_path", bench), ("direct_14in_2out", direct["direct_14in_2out"])]:
        b, r = st(fn, q0, reps=30)
        res[name].setdefault("chained_build", []).append(round(b, 2))
        res[name].setdefault("chained_eval", []).append(round(r, 2))
    print(json.dumps(res), flush=True)
Path(os.environ.get("OUT", "/tmp"), "host_s12.json").write_text(json.dumps(res, indent=1))
