"""Fill a TurboQuant KV cache with real-shaped K/V and report memory and attention error.

The shapes are SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, 9 query
heads) by default; keys get a few large outlier channels and a per-head offset,
as real keys do, which is what makes key quantization hard.

    python examples/cache_demo.py [--tokens 2048] [--layers 30] [--kv-heads 3] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import time

import turbospark_mlx as ts  # isort: skip  (before mlx.core: MKL under MLX's CPU matmuls on Linux)

import mlx.core as mx
from turbospark_mlx.quant.reference import fp16_attention_ref


def synthetic_kv(B: int, H: int, L: int, D: int) -> tuple[mx.array, mx.array]:
    keys = mx.random.normal((B, H, L, D))
    outliers = mx.zeros((D,)).at[mx.array([3, D // 2, D - 5])].add(8.0)
    keys = keys * (1 + outliers) + mx.random.normal((1, H, 1, D))
    values = mx.random.normal((B, H, L, D))
    return keys.astype(mx.float16), values.astype(mx.float16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512, help="rows per write (prefill chunk)")
    args = p.parse_args()
    mx.random.seed(0)

    B, H, L, D = 1, args.kv_heads, args.tokens, args.head_dim
    data = [synthetic_kv(B, H, L, D) for _ in range(args.layers)]
    queries = [mx.random.normal((B, args.q_heads, 1, D)) for _ in range(args.layers)]
    specs = [ts.LayerSpec(H, D) for _ in range(args.layers)]
    exact = [fp16_attention_ref(q, k, v, scale=D**-0.5) for q, (k, v) in zip(queries, data)]

    print(f"{args.layers} layers x {H} KV heads x head_dim {D}, {L} tokens, B={B}")
    print(f"{'preset':<7} {'KV bytes':>12} {'vs fp16':>8} {'bytes/token/head':>17} {'attn rel err':>13} {'fill s':>7}")
    for name, preset in ts.PRESETS.items():
        cache = ts.KVCacheManager(specs, preset, max_rows=args.chunk, step=L)
        t0 = time.perf_counter()
        for i, (k, v) in enumerate(data):
            for s in range(0, L, args.chunk):
                ts.store_kv(cache, i, s, k[:, :, s : s + args.chunk], v[:, :, s : s + args.chunk])
            mx.eval(cache.layer_arrays(i))
        fill = time.perf_counter() - t0
        errs = []
        for i, q in enumerate(queries):
            out = ts.attention_any(cache, i, q)
            errs.append((mx.linalg.norm(out - exact[i]) / mx.linalg.norm(exact[i])).item())
        ratio = cache.nbytes / cache.fp16_nbytes()
        print(
            f"{name:<7} {cache.nbytes:>12,} {ratio:>8.3f} {preset.bytes_per_token(D):>17} "
            f"{sum(errs) / len(errs):>13.4f} {fill:>7.2f}"
        )


if __name__ == "__main__":
    main()
