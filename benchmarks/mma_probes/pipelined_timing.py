"""Per-call time when the host builds the next chunk of calls while the GPU runs the previous
one, as mlx-lm's generate loop overlaps a step's graph building with the last step's eval
(mx.async_eval): chunks of 20 chained calls, each chunk async-evaluated as soon as it is built,
150 chunks. Against the benchmark's amortized time (build, then eval, nothing overlapped).

    python benchmarks/mma_probes/pipelined_timing.py   # writes $OUT/pipelined.json
"""
import json, os, statistics, sys, time
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from chained_timing_lib import random_layer, st  # noqa: E402
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant  # noqa: E402
from turbospark_mlx.tq_kernels import tq_decode_mma  # noqa: E402

D, Hq, Hkv, CHUNK, CHUNKS = 128, 32, 8, 20, 150


def pipelined(fn, q0):
    q = fn(q0); mx.eval(q); mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(CHUNKS):
        for _ in range(CHUNK):
            q = fn(q)
        mx.async_eval(q)
    mx.eval(q); mx.synchronize()
    return (time.perf_counter() - t0) / (CHUNK * CHUNKS) * 1e6


res = []
for L in (4096, 32768, 131072):
    row = {"L": L}
    for preset, bits in (("tq4", 4), ("tq3", 3)):
        quant = LayerQuant(0, side_quant(bits, D, "auto", 0, 0, "k"), side_quant(bits, D, "auto", 0, 0, "v"))
        q0, kc, kn, vc, vn, k, v = random_layer(quant, L, Hq, Hkv, D)
        fns = {"sdpa": lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5),
               preset: lambda q: tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D**-0.5, position=L - 1)}
        for rnd in range(3):  # interleaved rounds
            for n, f in fns.items():
                row.setdefault(f"{n}_pipelined", []).append(round(pipelined(f, q0), 1))
                b, e = st(f, q0, reps=20)
                row.setdefault(f"{n}_amortized", []).append(round(b + e, 1))
    for key in list(row):
        if key != "L":
            row[key] = statistics.median(row[key])
    for preset in ("tq4", "tq3"):
        for how in ("pipelined", "amortized"):
            row[f"{preset}_{how}_x_sdpa"] = round(row[f"{preset}_{how}"] / row[f"sdpa_{how}"], 3)
    print(json.dumps(row), flush=True)
    res.append(row)
Path(os.environ.get("OUT", "/tmp"), "pipelined.json").write_text(json.dumps(res, indent=1))
