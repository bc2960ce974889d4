# 50 evals of 20 chained calls, tq_decode_mma (wrapper) then SDPA, at 4k: for nsys NVTX ranges.
import sys, mlx.core as mx
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant
import turbospark_mlx.tq_kernels as tk
D, Hq, Hkv, L = 128, 32, 8, 4096
which = sys.argv[1]
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
vc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L)); vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
k = mx.random.normal((1, Hkv, L, D)).astype(mx.float16); v = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
mx.eval(q0, kc, vc, kn, vn, k, v)
f = (lambda q: tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1)) if which == "mma" else \
    (lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5))
for _ in range(60):
    x = q0
    for _ in range(20): x = f(x)
    mx.eval(x); mx.synchronize()
