# Session 12: the whole GPU timeline of N chained tq_decode_mma calls in one eval (stamped
# kernel, tq4, llama shape, 128k keys): every gap between consecutive calls (graph boundaries
# show as outliers), GPU time from the first start to the last end, and the eval's wall time,
# beside the unstamped kernel's build and eval per call in the same process.
import json, os, statistics, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from chained_timing_lib import random_layer, st  # noqa: E402
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

D, Hq, Hkv = 128, 32, 8
L = int(os.environ.get("L", "131072"))
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
q0, kc, kn, vc, vn, k, v = random_layer(quant, L)
cfg = tk._mma_config(quant, 4, 1, D, D**-0.5, False, False, mx.float16)
splits = tk._mma_splits(cfg, -(-L // 16), Hkv)
kern = mk.make("kernels/tq_decode_mma.kernel", cfg, stamps=True)
res = {"L": L}
for N in (10, 20, 40):
    rows = []
    for rep in range(10):
        build, ev, start, end, _ = mk.stamped_chain(kern, cfg, splits, q0, kc, kn, vc, vn, L, Hkv, N)
        rows.append(dict(build=build, eval=ev,
                         gpu=(end[-1] - start[0]) / N / 1e3,
                         gaps=[round(float(x) / 1e3, 1) for x in start[1:] - end[:-1]],
                         spans=[round(float(x) / 1e3, 1) for x in end - start]))
    res[f"stamped_N{N}"] = rows[2:]
    print(N, json.dumps({k: round(statistics.median(r[k] for r in rows[2:]), 1) for k in ("build", "eval", "gpu")}))
    print("  gaps", rows[5]["gaps"])
    print("  spans", rows[5]["spans"])
sdpa = lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
tq = lambda q: tk.tq_decode_attention(q, kc, kn, vc, vn, quant, scale=D**-0.5, position=L - 1, backend="cuda")
for name, fn in (("sdpa", sdpa), ("tq4", tq), ("sdpa", sdpa), ("tq4", tq)):
    b, r = st(fn, q0, reps=30)
    res.setdefault(name, []).append([round(b, 1), round(r, 1)])
    print(name, round(b, 1), round(r, 1))
Path(os.environ.get("OUT", "/tmp"), f"chain_timeline_{L}.json").write_text(json.dumps(res, indent=1))
