# Session 12: chained timings (20 calls per eval, build and eval us per call) of FP16 SDPA and
# the benchmark's path (tq_decode_attention, automatic choice) at 4k / 32k / 128k keys, llama
# shape, ROUNDS interleaved rounds. Uses only what every tree since session 9 has, so it can run
# against an older tree (PYTHONPATH): writes $OUT/$P12.
import json, os, statistics, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import random_layer, st  # noqa: E402
from turbospark_mlx import tq_kernels as tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

D, Hq, Hkv = 128, 32, 8
res = []
for preset, bits in (("tq4", 4), ("tq3", 3)):
    quant = LayerQuant(0, side_quant(bits, D, "auto", 0, 0, "k"), side_quant(bits, D, "auto", 0, 0, "v"))
    for L in (4096, 32768, 131072):
        q0, kc, kn, vc, vn, k, v = random_layer(quant, L, Hq, Hkv, D)
        fns = {"sdpa": lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5),
               "tq": lambda q: tk.tq_decode_attention(q, kc, kn, vc, vn, quant, scale=D**-0.5, position=L - 1, backend="cuda")}
        acc = {n: [] for n in fns}
        for _ in range(int(os.environ.get("ROUNDS", "3"))):
            for n, f in fns.items():
                acc[n].append(st(f, q0, reps=40))
        row = dict(preset=preset, L=L)
        for n, xs in acc.items():
            row[n] = dict(build=round(statistics.median(x[0] for x in xs), 2), eval=round(statistics.median(x[1] for x in xs), 2))
        row["x_sdpa"] = round(statistics.median((t[0] + t[1]) / (s[0] + s[1]) for t, s in zip(acc["tq"], acc["sdpa"])), 3)
        print(json.dumps(row), flush=True)
        res.append(row)
Path(os.environ.get("OUT", "/tmp"), os.environ.get("P12", "ab.json")).write_text(json.dumps(res, indent=1))
