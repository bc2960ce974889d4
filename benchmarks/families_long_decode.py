"""Long greedy decode past the sliding window: cache bytes and peak memory, FP16 vs TurboQuant.

For each family (tiny random model from tests/families.py, window 16, one
sliding and one global layer; gemma4 also two KV-shared layers) decode
window + N tokens and record, at checkpoints: positions, cache bytes per
layer kind, what an all-FP16 growing cache would hold, and the peak memory
above the start of decoding (mx.get_peak_memory). Results go to
benchmarks/results/families_long_decode.md (machine and MLX device inside).

    python benchmarks/families_long_decode.py [--tokens 2048] [--kv fp16 tq4]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from families import FAMILIES, LONG_CONFIGS, pair  # noqa: E402

from turbospark_mlx import make_cache  # noqa: E402


def run(family: str, kv: str, past_window: int, checkpoints: list[int]) -> list[dict]:
    config = LONG_CONFIGS[family]
    _, model = pair(family, config)
    window, max_rows = config["sliding_window"], 8
    cache = make_cache(model, kv, max_rows=max_rows, step=256)
    specs = model.kv_layer_specs()
    # An all-FP16 growing cache (no rings, no compression, no sharing) for comparison.
    naive_per_token = sum(4 * s.n_kv_heads * s.head_dim for s in specs)
    tok = mx.random.randint(0, config["vocab_size"], (1, 8), key=mx.random.key(1))
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    rows, t0 = [], time.perf_counter()
    total = window + past_window
    for step in range(1, total + 1):
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        if step - window in checkpoints:
            ring = sum(
                cache.layer_nbytes(i) for i, s in enumerate(specs) if s.window and s.shared_from is None
            )
            glob = sum(
                cache.layer_nbytes(i) for i, s in enumerate(specs) if not s.window and s.shared_from is None
            )
            rows.append(
                dict(
                    family=family,
                    kv=kv,
                    past_window=step - window,
                    positions=cache.offset,
                    ring_bytes=ring,
                    global_bytes=glob,
                    naive_fp16_bytes=naive_per_token * cache.offset,
                    peak_above_start=mx.get_peak_memory() - base,
                    tok_per_s=step / (time.perf_counter() - t0),
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens decoded past the window")
    ap.add_argument("--kv", nargs="+", default=["fp16", "tq4"])
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    checkpoints = sorted({args.tokens // 4, args.tokens // 2, args.tokens})
    rows = [r for f in args.families for kv in args.kv for r in run(f, kv, args.tokens, checkpoints)]
    header = (
        f"# Long decode past the sliding window\n\nMachine: {platform.machine()} {platform.system()}, "
        f"{os.cpu_count()} cores, MLX {mx.__version__} on {mx.default_device()}.\n"
        f"Command: `python benchmarks/families_long_decode.py --tokens {args.tokens} --kv {' '.join(args.kv)}`\n\n"
        "Tiny random models (tests/families.py LONG_CONFIGS, window 16). ring/global = bytes held by\n"
        "sliding-layer rings / global layers; naive = an all-FP16 growing cache for every layer;\n"
        "peak = mx.get_peak_memory() above the active memory at the start of decoding.\n\n"
        "| family | kv | past window | positions | ring bytes | global bytes | naive FP16 bytes | peak MiB | tok/s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['family']} | {r['kv']} | {r['past_window']} | {r['positions']} | {r['ring_bytes']:,} | "
        f"{r['global_bytes']:,} | {r['naive_fp16_bytes']:,} | {r['peak_above_start'] / 2**20:.2f} | {r['tok_per_s']:.0f} |"
        for r in rows
    ]
    text = header + "\n".join(lines) + "\n"
    print(text)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "families_long_decode.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
