# Host cost of one custom-kernel call on MLX CUDA: graph build (the Python call) and eval of
# 20 chained calls whose GPU work is negligible, by number of inputs and outputs, shape
# arguments and source length, a precompiled (PTX) launch, a plain mx op, SDPA, and
# tq_decode_mma's own call. Writes $OUT/host_cost.json.
import glob, json, os, sys, tempfile
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant
from chained_timing_lib import build_only, random_layer, st  # noqa: E402


def chained(fn, x0):
    b, r = st(fn, x0, reps=40)
    return round(b, 2), round(r, 2)


res = {}
def rec(name, fn, x0):
    res[name] = dict(build_only=build_only(fn, x0, 1000), chained=chained(fn, x0))
    print(name, res[name], flush=True)


x0 = mx.zeros((1,), mx.float32)
mx.eval(x0)
rec("mx_add", lambda x: x + 1, x0)
SRC = "if (threadIdx.x == 0) out[0] = inp[0] + 1.0f;"
PAD = "// " + "x" * 1000 + "\n"
for n_in, n_out, shape_refs, pad in [(1, 1, 0, 0), (1, 2, 0, 0), (5, 1, 0, 0), (10, 1, 0, 0), (15, 1, 0, 0),
                                     (15, 2, 0, 0), (15, 2, 3, 0), (15, 2, 3, 1), (1, 1, 0, 1)]:
    names = ["inp"] + [f"c{i}" for i in range(n_in - 1)]
    consts = [mx.zeros((8,), mx.uint32) for _ in range(n_in - 1)]
    mx.eval(consts)
    src = SRC + "".join(f"\n(void)c{i}_shape;" for i in range(shape_refs))
    k = mx.fast.cuda_kernel(name=f"tiny_{n_in}_{n_out}_{shape_refs}_{pad}", input_names=names,
                            output_names=["out", "o2"][:n_out], source=src, header=PAD if pad else "")
    f = (lambda k, consts, n_out: lambda x: k(inputs=[x, *consts], grid=(32, 1, 1), threadgroup=(32, 1, 1),
         output_shapes=[(1,)] * n_out, output_dtypes=[mx.float32] * n_out)[0])(k, consts, n_out)
    rec(f"tiny_{n_in}in_{n_out}out_{shape_refs}shape" + ("_pad1k" if pad else ""), f, x0)

# A precompiled launch of the same tiny kernel: MLX's PTX cache holds what it compiled.
ptx_dirs = glob.glob(os.path.join(tempfile.gettempdir(), "mlx", "*", "ptx"))
found = [p for d in ptx_dirs for p in glob.glob(os.path.join(d, "*tiny_1_1_0_0*.ptx"))]
res["ptx_files"] = found
if found:
    ptx = Path(found[0]).read_bytes()
    mangled = Path(found[0]).with_suffix(".txt").read_text().split("\t")[-1].strip()
    res["ptx_bytes"], res["ptx_mangled"] = len(ptx), mangled
    def pre(x, ptx=ptx, mangled=mangled):
        return mx.fast.precompiled_cuda_kernel(name=mangled, compiled_source=ptx, inputs=[x], output_shapes=[(1,)],
                                               output_dtypes=[mx.float32], scalars=[], grid=(32, 1, 1),
                                               threadgroup=(32, 1, 1))[0]
    try:
        rec("precompiled_tiny", pre, x0)
    except Exception as e:  # noqa: BLE001 - a probe: record what failed
        res["precompiled_tiny"] = repr(e)
        print("precompiled_tiny", repr(e), flush=True)

D, Hq, Hkv = 128, 32, 8
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
for L in (64, 4096):
    q0, kc, kn, vc, vn, k, v = random_layer(quant, L, Hq, Hkv, D)
    rec(f"sdpa_{L}", lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5), q0)
    rec(f"mma_wrapper_{L}", lambda q: tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1), q0)
Path(os.environ.get("OUT", "/tmp"), "host_cost.json").write_text(json.dumps(res, indent=1))
