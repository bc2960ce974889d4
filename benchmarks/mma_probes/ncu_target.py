import sys, mlx.core as mx
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant
from turbospark_mlx.tq_kernels import tq_decode_mma
D, Hq, Hkv = 128, 32, 8
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
for L in (4096, 131072):
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    mx.eval(q0, kc, kn)
    for _ in range(3): mx.eval(tq_decode_mma(q0, kc, kn, kc, kn, quant, scale=D**-0.5, position=L - 1))
