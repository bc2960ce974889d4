# ncu target (session 11): tq4 and tq3 tq_decode_mma at 128k keys (llama shape) and FP16 SDPA on
# the same shape, two evals each, so `ncu --page details` gives each kernel's own duration.
import sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from chained_timing_lib import random_layer  # noqa: E402
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant  # noqa: E402
from turbospark_mlx.tq_kernels import tq_decode_mma  # noqa: E402

D, L = 128, 131072
for bits in (4, 3):
    quant = LayerQuant(0, side_quant(bits, D, "auto", 0, 0, "k"), side_quant(bits, D, "auto", 0, 0, "v"))
    q0, kc, kn, vc, vn, k, v = random_layer(quant, L)
    for _ in range(2):
        mx.eval(tq_decode_mma(q0, kc, kn, vc, vn, quant, scale=D**-0.5, position=L - 1))
    if bits == 4:
        for _ in range(2):
            mx.eval(mx.fast.scaled_dot_product_attention(q0, k, v, scale=D**-0.5))
    del kc, vc, kn, vn, k, v
