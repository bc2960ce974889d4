"""Host time of one tq_decode_mma call with the kernel stubbed (CPU is enough).
    python benchmarks/mma_probes/wrapper_host_time.py REPO_ROOT   # e.g. a `git archive 2d5475d` copy
"""
import sys, time
sys.path.insert(0, sys.argv[1])
import mlx.core as mx
import turbospark_mlx.tq_kernels as tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant
D, Hq, Hkv, L = 128, 32, 8, 4096
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
q = mx.zeros((1, Hq, 1, D), mx.float16); kc = mx.zeros((1, Hkv, L, quant.k.words), mx.uint32); kn = mx.zeros((1, Hkv, L))
stub = lambda **kw: (kw["inputs"][0], None)
if hasattr(tk, "_mma_launch"):
    tk._mma_launch(quant, q, Hkv, D ** -0.5, False, False)._kernel = stub
else:
    tk._mma_config(quant, 4, 1, D, D ** -0.5, False, False, mx.float16).kernel.append(stub)
f = lambda: tk.tq_decode_mma(q, kc, kn, kc, kn, quant, scale=D ** -0.5, position=L - 1)
r = []
for _ in range(5):
    f(); t0 = time.perf_counter()
    for _ in range(20000): f()
    r.append((time.perf_counter() - t0) / 20000 * 1e6)
print(sys.argv[1], "median us", sorted(r)[2])
