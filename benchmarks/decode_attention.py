"""Decode attention on one GPU: TurboQuant kernels vs FP16 SDPA vs mlx-lm-style affine attention.

One run measures, for each shape and context:
  * amortized time: N calls chained (each call's output is the next call's query)
    inside one mx.eval, divided by N, as a decode step inside a model graph sees
    it (one mx.eval costs ~40 us on MLX CUDA, which would swamp one kernel);
  * single-eval time: one call per mx.eval (median);
  * paired rounds: SDPA and the TurboQuant kernels re-timed interleaved, amortized and
    overlapped (graph building overlapping the GPU, as mlx-lm's generate loop runs);
  * bytes each method must read and the GB/s that implies, next to the copy
    bandwidth measured in the same run;
  * the commit (quantize) kernel's time per decode step (K and V of one token);
  * peak memory of one decode step above what is resident before it.
Writes <out>/decode_attention.json and .md (default: benchmarks/results/).

    python benchmarks/decode_attention.py                  # on the GPU machine
    python benchmarks/decode_attention.py --tiny --out DIR # seconds on a CPU: checks the script, not kernels

On the reference backend (a CPU-only MLX build) the TurboQuant rows time the reference
attention (`tq_attention_ref`), as `attention_any` runs there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turbospark_mlx.attention import attention_mask  # noqa: E402
from turbospark_mlx.gpu.backend import auto_backend  # noqa: E402
from turbospark_mlx.gpu.decode import decode_plan, tq_decode_attention  # noqa: E402
from turbospark_mlx.gpu.decode_mma import mma_plan, tq_mma_unsupported  # noqa: E402
from turbospark_mlx.gpu.quantize import tq_quantize  # noqa: E402
from turbospark_mlx.quant.reference import tq_attention_ref  # noqa: E402
from turbospark_mlx.quant.tables import LayerQuant, side_quant  # noqa: E402

# Presets timed, (K bits, V bits): the tq4 / tq3 / k8v4 rows of results/decode_attention.json.
PRESETS = {"tq4": (4, 4), "tq3": (3, 3), "k8v4": (8, 4)}


def timed(fn, q0, n_chain: int, repeats: int = 11, single: bool = True) -> tuple[float, float | None]:
    """(median amortized seconds per call over n_chain chained calls, median single-eval
    seconds or None without `single`)."""
    mx.eval(fn(q0))
    mx.eval(fn(q0))
    amort = []
    for _ in range(repeats):
        q = q0
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(n_chain):
            q = fn(q)
        mx.eval(q)
        mx.synchronize()
        amort.append((time.perf_counter() - t) / n_chain)
    if not single:
        return statistics.median(amort), None
    singles = []
    for _ in range(2 * repeats):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn(q0))
        mx.synchronize()
        singles.append(time.perf_counter() - t)
    return statistics.median(amort), statistics.median(singles)


def _random_words(shape) -> mx.array:
    """Uniformly random uint32 words (two 16-bit halves)."""
    lo = mx.random.randint(0, 1 << 16, shape).astype(mx.uint32)
    hi = mx.random.randint(0, 1 << 16, shape).astype(mx.uint32)
    return lo | (hi << 16)


def copy_bandwidth(n_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second of a large elementwise copy (x + 1 on float16)."""
    a = mx.random.normal((n_bytes // 2,)).astype(mx.float16)
    mx.eval(a)
    amort, _ = timed(lambda x: x + 1, a, 10, repeats=5)
    return 2 * n_bytes / amort


def peak_extra(fn, q) -> int:
    """Peak memory of one call above the memory resident before it."""
    mx.eval(fn(q))
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn(q))
    mx.synchronize()
    return mx.get_peak_memory() - base


def bench_shape(name, Hq, Hkv, D, contexts, n_chain, results, sweep=False, rounds=0):
    G = Hq // Hkv
    scale = D**-0.5
    for L in contexts:
        row = {
            "shape": name,
            "B": 1,
            "Hq": Hq,
            "Hkv": Hkv,
            "D": D,
            "context": L,
            "methods": {},
        }
        q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
        k = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
        v = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
        mx.eval(q0, k, v)

        def sdpa(q):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

        # The FP16 baseline is timed again after every other method and the ratios use the
        # median of all its timings in the row: on the H200 the same kernel measures up to
        # 25% apart within one run, minutes apart, and a ratio should compare like with like.
        sdpa_runs: list[float] = []

        def rec(method, fn, q, nbytes, peak=True):
            amort, single = timed(fn, q, n_chain)
            if method != "fp16_sdpa":
                sdpa_runs.append(timed(sdpa, q0, n_chain, single=False)[0])
            row["methods"][method] = {
                "amortized_us": amort * 1e6,
                "single_eval_us": single * 1e6,
                "bytes": nbytes,
                "GBps": nbytes / amort / 1e9,
                "peak_extra_MB": peak_extra(fn, q) / 2**20 if peak else None,
            }

        rec("fp16_sdpa", sdpa, q0, 2 * k.nbytes)
        paired = {"fp16_sdpa": sdpa}  # timed again in interleaved rounds at the end of the row
        sdpa_runs.append(row["methods"]["fp16_sdpa"]["amortized_us"] / 1e6)
        # kv_start / ring layers: SDPA with a boolean mask (what attention_any uses on FP16 layers).
        mask = attention_mask(mx.arange(L), mx.arange(L - 1, L), 7)
        rec(
            "fp16_sdpa_mask",
            lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
            q0,
            2 * k.nbytes,
            peak=False,
        )
        for bits in (4, 8):
            kq = mx.quantize(k, group_size=64, bits=bits)
            vq = mx.quantize(v, group_size=64, bits=bits)
            mx.eval(kq, vq)
            nbytes = sum(a.nbytes for a in (*kq, *vq))

            def affine(q, kq=kq, vq=vq, bits=bits):
                qs = (q * scale).reshape(1, Hkv, G, D)  # GQA rows folded into the matmul rows
                s = mx.quantized_matmul(qs, *kq, transpose=True, group_size=64, bits=bits)
                p = mx.softmax(s.astype(mx.float32), axis=-1, precise=True).astype(q.dtype)
                o = mx.quantized_matmul(p, *vq, transpose=False, group_size=64, bits=bits)
                return o.reshape(1, Hq, 1, D)

            try:
                rec(f"affine{bits}_mlx_lm_style", affine, q0, nbytes)
            except Exception as e:  # report, do not hide
                row["methods"][f"affine{bits}_mlx_lm_style"] = {"error": str(e)[:200]}
            del kq, vq
        for preset, (kb, vb) in PRESETS.items():
            quant = LayerQuant(
                0,
                side_quant(kb, D, "auto", 0, 0, "k"),
                side_quant(vb, D, "auto", 0, 0, "v"),
            )
            # Random codes: every bit pattern is a valid index (never time on zeros).
            kc, vc = (_random_words((1, Hkv, L, w)) for w in (quant.k.words, quant.v.words))
            kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
            vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
            mx.eval(kc, vc, kn, vn)
            nbytes = sum(a.nbytes for a in (kc, vc, kn, vn))
            backend = auto_backend()

            def tq(q, quant=quant, kc=kc, vc=vc, kn=kn, vn=vn, variant="auto", **kw):
                if backend == "reference":  # no kernel: what attention_any runs on a CPU
                    return tq_attention_ref(q, kc, kn, vc, vn, quant, scale=scale)
                return tq_decode_attention(
                    q,
                    kc,
                    kn,
                    vc,
                    vn,
                    quant,
                    scale=scale,
                    position=L - 1,
                    backend=backend,
                    variant=variant,
                    **kw,
                )

            # `_kernel`: what attention_any runs (the automatic choice); on CUDA also each
            # kernel forced: `_mma` (tensor cores, where it serves) and `_dialect` (one source).
            rec(f"{preset}_kernel", tq, q0, nbytes)
            paired[f"{preset}_kernel"] = tq
            mma = backend == "cuda" and tq_mma_unsupported(quant, G, 1, D) is None
            if mma:
                rec(f"{preset}_mma", lambda q: tq(q, variant="mma"), q0, nbytes, peak=False)
                paired[f"{preset}_mma"] = lambda q, tq=tq: tq(q, variant="mma")
                plan = mma_plan(
                    quant,
                    G,
                    1,
                    D,
                    Hkv,
                    L,
                    scale=scale,
                    has_starts=False,
                    has_sink=False,
                    out_dtype=mx.float16,
                )
                row["methods"][f"{preset}_mma"]["plan"] = {
                    "splits": plan["splits"],
                    "tiles_per_warp": plan["tiles_per_warp"],
                }
                rec(f"{preset}_dialect", lambda q: tq(q, variant="dialect"), q0, nbytes, peak=False)
            plan = decode_plan(quant, G, 1, D, Hkv, L)
            row["methods"][f"{preset}_dialect" if mma else f"{preset}_kernel"]["plan"] = {
                "tiles": plan["tiles"],
                **{n: v for n, v in plan["template"] if n in ("NT", "TT")},
            }
            if L == contexts[0]:
                # Commit of one decode step: K and V rows of one token, all KV heads.
                x = mx.random.normal((1, Hkv, 1, D)).astype(mx.float16)

                def commit(x, quant=quant):
                    kcodes, kn_ = tq_quantize(x, quant.k, backend=backend)
                    vcodes, vn_ = tq_quantize(x, quant.v, backend=backend)
                    # chain: next input depends on this commit's outputs
                    return (
                        x
                        + (kn_[..., None] + vn_[..., None]).astype(x.dtype) * 0
                        + ((kcodes[..., :1] + vcodes[..., :1]) & 0).astype(x.dtype)
                    )

                amort, single = timed(commit, x, n_chain)
                row.setdefault("commit", {})[preset] = {
                    "amortized_us": amort * 1e6,
                    "single_eval_us": single * 1e6,
                }
            if sweep and mma and L == contexts[-1]:
                # Keys per warp (16-key tiles) around the heuristic's choice.
                for tpw in (4, 8, 16, 32, 64):
                    rec(
                        f"{preset}_mma_TPW{tpw}",
                        lambda q, tpw=tpw: tq(q, _tiles_per_warp=tpw),
                        q0,
                        nbytes,
                        peak=False,
                    )
            del kc, vc, kn, vn
        if rounds:
            paired_rounds(row, paired, q0, n_chain, rounds)
        base = row["methods"]["fp16_sdpa"]
        base["amortized_runs_us"] = [round(t * 1e6, 1) for t in sdpa_runs]
        base["amortized_us"] = statistics.median(sdpa_runs) * 1e6
        base["GBps"] = base["bytes"] / (base["amortized_us"] / 1e6) / 1e9
        fp16 = base["amortized_us"]
        for m in row["methods"].values():
            if "amortized_us" in m:
                m["vs_fp16_sdpa"] = m["amortized_us"] / fp16
        a4 = row["methods"].get("affine4_mlx_lm_style", {}).get("amortized_us")
        if a4:
            for p in PRESETS:
                row["methods"][f"{p}_kernel"]["speedup_vs_affine4"] = (
                    a4 / row["methods"][f"{p}_kernel"]["amortized_us"]
                )
        results.append(row)
        print(
            json.dumps(
                {
                    "shape": name,
                    "L": L,
                    **{k: round(v.get("amortized_us", -1), 1) for k, v in row["methods"].items()},
                }
            ),
            flush=True,
        )
        del k, v


def overlapped(fn, q0, n_chain: int, chunks: int = 20) -> float:
    """Seconds per call with graph building overlapping the GPU, as mlx-lm's generate loop runs
    (it builds a step while the last one evaluates): chunks of n_chain chained calls, each
    async-evaluated as soon as it is built (median of 3 runs). The amortized time above builds
    a whole chain before running it, so it adds each call's host time to its GPU time."""
    mx.eval(fn(q0))
    runs = []
    for _ in range(3):
        q = q0
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(chunks):
            for _ in range(n_chain):
                q = fn(q)
            mx.async_eval(q)
        mx.eval(q)
        mx.synchronize()
        runs.append((time.perf_counter() - t) / (chunks * n_chain))
    return statistics.median(runs)


def paired_rounds(row, fns, q0, n_chain: int, rounds: int) -> None:
    """Time FP16 SDPA and the TurboQuant kernels again in `rounds` interleaved rounds (each
    round: every method once, SDPA first, median of 5 chained evals) and store per method the
    median over rounds of its time / SDPA's time in the same round. A ratio of timings seconds
    apart: the sequential pass above times methods minutes apart, and on the H200 machines
    host-side drift moves the same kernel's two rows up to 20% apart."""
    runs = {n: [] for n in fns}
    over = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            runs[n].append(timed(fn, q0, n_chain, repeats=5, single=False)[0])
            over[n].append(overlapped(fn, q0, n_chain))
    for n, ts in runs.items():
        if n == "fp16_sdpa":
            continue
        ratios = sorted(t / b for t, b in zip(ts, runs["fp16_sdpa"]))
        over_ratios = sorted(t / b for t, b in zip(over[n], over["fp16_sdpa"]))
        row["methods"][n]["paired"] = {
            "rounds_us": [round(t * 1e6, 1) for t in ts],
            "sdpa_rounds_us": [round(t * 1e6, 1) for t in runs["fp16_sdpa"]],
            "vs_fp16_sdpa": statistics.median(ratios),
            "vs_fp16_sdpa_range": [ratios[0], ratios[-1]],
            "overlapped_rounds_us": [round(t * 1e6, 1) for t in over[n]],
            "sdpa_overlapped_rounds_us": [round(t * 1e6, 1) for t in over["fp16_sdpa"]],
            "overlapped_vs_fp16_sdpa": statistics.median(over_ratios),
            "overlapped_vs_fp16_sdpa_range": [over_ratios[0], over_ratios[-1]],
        }


def markdown(meta, rows) -> str:
    lines = [
        "# Decode attention benchmark",
        "",
        f"Machine: {meta['device']}; MLX {meta['mlx']}; backend {meta['backend']}; {meta['date']}.",
        f"Copy bandwidth measured in this run: {meta['copy_GBps']:.0f} GB/s (read + write of a "
        f"{meta.get('copy_bytes', 2 << 30) / 2**20:g} MiB float16 `x + 1`).",
        f"Amortized = {meta['n_chain']} calls chained in one `mx.eval`, divided by {meta['n_chain']} (median of 11); single = one call per eval (median of 22).",
        "FP16 SDPA amortized (and every x FP16 SDPA) = the median of its timings in the row: it is timed again after each other method.",
        f"Command: `{meta['command']}`",
        "",
        "| shape | context | method | amortized us | single-eval us | MB read | GB/s | x FP16 SDPA | peak extra MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, m in r["methods"].items():
            if "error" in m:
                lines.append(f"| {r['shape']} | {r['context']} | {name} | error: {m['error']} | | | | | |")
                continue
            peak = "" if m.get("peak_extra_MB") is None else f"{m['peak_extra_MB']:.1f}"
            lines.append(
                f"| {r['shape']} | {r['context']} | {name} | {m['amortized_us']:.1f} | {m['single_eval_us']:.1f} | "
                f"{m['bytes'] / 1e6:.1f} | {m['GBps']:.0f} | {m['vs_fp16_sdpa']:.2f} | {peak} |"
            )
    paired = [(r, n, m["paired"]) for r in rows for n, m in r["methods"].items() if "paired" in m]
    if paired:
        lines += [
            "",
            f"Paired rounds: FP16 SDPA and each kernel timed again in {len(paired[0][2]['rounds_us'])} "
            "interleaved rounds (SDPA first in each, median of 5 chained evals each); x FP16 SDPA = the "
            "median over rounds of the kernel's time / SDPA's in the same round, with the range over rounds. "
            "Overlapped = the same calls with graph building overlapping the GPU, as mlx-lm's generate "
            f"loop runs: chunks of {meta['n_chain']} chained calls, each async-evaluated as soon as "
            "it is built (the amortized time builds a whole chain first, adding each call's host time).",
            "",
            "| shape | context | method | median us | x FP16 SDPA (paired) | range "
            "| overlapped us | x FP16 SDPA (overlapped) | range |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r, n, pr in paired:
            lo, hi = pr["vs_fp16_sdpa_range"]
            olo, ohi = pr["overlapped_vs_fp16_sdpa_range"]
            lines.append(
                f"| {r['shape']} | {r['context']} | {n} | {statistics.median(pr['rounds_us']):.1f} | "
                f"{pr['vs_fp16_sdpa']:.2f} | {lo:.2f}-{hi:.2f} | "
                f"{statistics.median(pr['overlapped_rounds_us']):.1f} | "
                f"{pr['overlapped_vs_fp16_sdpa']:.2f} | {olo:.2f}-{ohi:.2f} |"
            )
    lines += [
        "",
        "Commit (tq_quantize of one token's K and V, all KV heads), per decode step:",
        "",
    ]
    lines += ["| shape | preset | amortized us | single-eval us |", "|---|---|---|---|"]
    for r in rows:
        for p, c in r.get("commit", {}).items():
            lines.append(f"| {r['shape']} | {p} | {c['amortized_us']:.1f} | {c['single_eval_us']:.1f} |")
    lines += [
        "",
        "Speed-up of the TurboQuant kernels over mlx-lm-style affine 4-bit attention:",
        "",
    ]
    for r in rows:
        s = ", ".join(
            f"{p} {r['methods'][f'{p}_kernel'].get('speedup_vs_affine4', float('nan')):.2f}x" for p in PRESETS
        )
        lines.append(f"- {r['shape']} @ {r['context']}: {s}")
    return "\n".join(lines) + "\n"


def probe(L: int = 131072, preset: str = "tq4") -> None:
    """A few decode calls at one shape, for a profiler (ncu) to pick kernels from."""
    kb, vb = PRESETS[preset]
    quant = LayerQuant(
        0,
        side_quant(kb, 128, "auto", 0, 0, "k"),
        side_quant(vb, 128, "auto", 0, 0, "v"),
    )
    kc, vc = (_random_words((1, 8, L, w)) for w in (quant.k.words, quant.v.words))
    kn = mx.random.uniform(0.5, 2.0, (1, 8, L))
    vn = mx.random.uniform(0.5, 2.0, (1, 8, L))
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    for _ in range(6):
        q = tq_decode_attention(
            q,
            kc,
            kn,
            vc,
            vn,
            quant,
            scale=128**-0.5,
            position=L - 1,
            backend=auto_backend(),
        )
        mx.eval(q)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--probe",
        action="store_true",
        help="only run a few tq4 decode calls at 128k (for ncu)",
    )
    ap.add_argument(
        "--out", default=None, help="directory for decode_attention.{json,md} (default: benchmarks/results)"
    )
    ap.add_argument("--n-chain", type=int, default=None, help="calls chained per eval (default 20; --tiny 2)")
    ap.add_argument("--contexts", default=None, help="keys per call (default 4096,32768,131072; --tiny 256)")
    ap.add_argument("--quick", action="store_true", help="llama shape only")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds re-timing SDPA and the TurboQuant kernels for paired ratios "
        "(0: none; default 7; --tiny 3)",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long run that checks this script (one small shape, 256 keys, a 16 MB copy); "
        "needs --out, its numbers say nothing about the GPU kernels",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time other keys-per-warp at the last context",
    )
    args = ap.parse_args()
    if args.probe:
        probe()
        return
    if args.tiny and args.out is None:
        ap.error("--tiny needs --out (its results must not replace benchmarks/results)")
    if args.n_chain is None:
        args.n_chain = 2 if args.tiny else 20
    if args.rounds is None:
        args.rounds = 3 if args.tiny else 7
    if args.contexts is None:
        args.contexts = "256" if args.tiny else "4096,32768,131072"
    contexts = [int(c) for c in args.contexts.split(",")]
    try:
        device = (
            subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
            ).stdout.strip()
            or platform.processor()
        )
    except FileNotFoundError:
        device = platform.platform()
    meta = {
        "device": device,
        "mlx": mx.__version__,
        "backend": auto_backend(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "n_chain": args.n_chain,
        "command": "python " + " ".join(sys.argv),
        "copy_bytes": 16 << 20 if args.tiny else 2 << 30,
    }
    meta["copy_GBps"] = copy_bandwidth(meta["copy_bytes"]) / 1e9
    print(json.dumps(meta), flush=True)
    rows: list = []
    if args.tiny:
        bench_shape("tiny Hq8 Hkv2 D64", 8, 2, 64, contexts, args.n_chain, rows, args.sweep, args.rounds)
    else:
        bench_shape("llama Hq32 Hkv8 D128", 32, 8, 128, contexts, args.n_chain, rows, args.sweep, args.rounds)
    if not args.quick and not args.tiny:
        bench_shape(
            "gemma-like Hq4 Hkv1 D256",
            4,
            1,
            256,
            contexts,
            args.n_chain,
            rows,
            args.sweep,
            args.rounds,
        )
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        for m in r["methods"].values():
            if "GBps" in m:
                m["fraction_of_copy_bw"] = m["GBps"] / meta["copy_GBps"]
    (out / "decode_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "decode_attention.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
