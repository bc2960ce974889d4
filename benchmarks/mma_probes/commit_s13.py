# Session 13: does MLX's graph commit policy decide the chained 128k ratio? MLX CUDA commits a
# CUDA graph once its inputs pass max_mb_per_buffer (1000 on the H200) "MB", counted in
# elements (device.cpp set_input_array: data_size()), or 100 nodes. FP16 K/V at 128k are 268 M
# elements a call (a commit every 4 calls); our uint32 codes 36 M (20 calls stay one graph, so
# the GPU waits for all 20 calls' encode). Chained build + eval per call (us) at N calls per
# eval, for SDPA and the benchmark's path (tq4, tq3), under the commit limits given as
# MLX_MAX_MB_PER_BUFFER / MLX_MAX_OPS_PER_BUFFER in the environment (one process per setting:
# run_s13a.sh). Prints one JSON line; appends it to $OUT/commit_s13.jsonl.
import json, os, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import random_layer, st  # noqa: E402
import turbospark_mlx.tq_kernels as tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

D, Hq, Hkv = 128, 32, 8
L = int(os.environ.get("L", 131072))
scale = D**-0.5
res = {"L": L, "mb": os.environ.get("MLX_MAX_MB_PER_BUFFER"), "ops": os.environ.get("MLX_MAX_OPS_PER_BUFFER")}
for preset, bits in (("tq4", 4), ("tq3", 3)):
    quant = LayerQuant(0, side_quant(bits, D, "auto", 0, 0, "k"), side_quant(bits, D, "auto", 0, 0, "v"))
    q0, kc, kn, vc, vn, k, v = random_layer(quant, L)
    fns = {
        preset: lambda q: tk.tq_decode_attention(q, kc, kn, vc, vn, quant, scale=scale, position=L - 1, backend="cuda"),
    }
    if preset == "tq4":
        fns["sdpa"] = lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    for n in (1, 2, 4, 10, 20):
        for name, fn in fns.items():
            b, e = st(fn, q0, n=n, reps=30)
            res.setdefault(name, {})[n] = [round(b, 2), round(e, 2)]
    del q0, kc, kn, vc, vn, k, v
for name in ("tq4", "tq3"):
    res[f"x_{name}_20"] = round(sum(res[name][20]) / sum(res["sdpa"][20]), 3)
line = json.dumps(res)
print(line, flush=True)
with open(Path(os.environ.get("OUT", "/tmp"), "commit_s13.jsonl"), "a") as f:
    f.write(line + "\n")
