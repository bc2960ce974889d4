# 50 evals of 20 chained calls, tq_decode_mma (wrapper) then SDPA, at 4k: for nsys NVTX ranges.
import sys, mlx.core as mx
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant
import turbospark_mlx.tq_kernels as tk
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import random_layer  # noqa: E402
D, Hq, Hkv, L = 128, 32, 8, 4096
which = sys.argv[1]
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
q0, kc, kn, vc, vn, k, v = random_layer(quant, L, Hq, Hkv, D)
f = (lambda q: tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1)) if which == "mma" else \
    (lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))
for _ in range(60):
    x = q0
    for _ in range(20): x = f(x)
    mx.eval(x); mx.synchronize()
