# Host cost of a custom kernel's second output vs one output and a view of it (slice +
# reshape), at tq_decode_mma's input count (14) and with 4 fewer inputs; GPU work negligible.
# Chained (20 calls per eval): build and eval us per call, interleaved rounds. $OUT/outputs_cost.json
import json, os, statistics, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import st  # noqa: E402

SRC = "if (threadIdx.x == 0) { out[0] = inp[0] + 1.0f; }\n(void)c0_shape; (void)c1_shape; (void)c2_shape;"
q0 = mx.zeros((1, 32, 1, 128), mx.float32)
mx.eval(q0)
fns = {}
for n_in in (14, 10):
    consts = [mx.zeros((8 + i,), mx.uint32) for i in range(n_in - 1)]
    mx.eval(consts)
    names = ["inp"] + [f"c{i}" for i in range(n_in - 1)]
    two = mx.fast.cuda_kernel(name=f"two_{n_in}", input_names=names, output_names=["out", "part"], source=SRC)
    one = mx.fast.cuda_kernel(name=f"one_{n_in}", input_names=names, output_names=["out"], source=SRC)
    kw = dict(grid=(512 * 16, 8, 1), threadgroup=(512, 1, 1))
    fns[f"{n_in}in_2out"] = (lambda k, c: lambda x: k(inputs=[x, *c], output_shapes=[x.shape, (70000,)],
                              output_dtypes=[mx.float32, mx.float32], **kw)[0])(two, consts)
    fns[f"{n_in}in_1out"] = (lambda k, c: lambda x: k(inputs=[x, *c], output_shapes=[x.shape],
                              output_dtypes=[mx.float32], **kw)[0])(one, consts)
    fns[f"{n_in}in_1out_view"] = (lambda k, c: lambda x: k(inputs=[x, *c], output_shapes=[(70000 + x.size,)],
                                  output_dtypes=[mx.float32], **kw)[0][: x.size].reshape(x.shape))(one, consts)
acc = {n: [] for n in fns}
for _ in range(3):
    for n, f in fns.items():
        acc[n].append(st(f, q0))
res = {n: dict(build=round(statistics.median(x[0] for x in v), 2), eval=round(statistics.median(x[1] for x in v), 2)) for n, v in acc.items()}
for n, v in res.items():
    print(n, v, flush=True)
Path(os.environ.get("OUT", "/tmp"), "outputs_cost.json").write_text(json.dumps(res, indent=1))
