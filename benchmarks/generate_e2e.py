"""Whole-model generation on an 8B-shaped llama: mlx-lm's caches vs TurboSpark's, and the package's own model.

One process, one random-weight model (hidden 4096, 32 layers, 32 query / 8 KV heads, head_dim 128,
vocab 128256, bf16 weights quantized to 4 bits, group 64), built with mlx-lm's llama; the package's
own llama (`turbospark_mlx.models.llama`) gets the same parameter arrays (nothing is copied).
`--family gemma3`: a Gemma-3-1B-shaped model instead (hidden 1152, 26 layers, five of six sliding
with a 512-row window, 4 query / 1 KV heads, head_dim 256, vocab 262144), mlx-lm's gemma3_text and
`turbospark_mlx.models.gemma3_text`; its sliding layers are FP16 rings in every row.
Rows: `mlx-lm fp16` (mlx-lm's KVCache), `mlx-lm tq4` / `k8v4` / `tq3` (turbospark_mlx.mlx_lm's
drop-in cache), `own fp16` / `own tq4` (a KVCacheManager on the own model). Per context and row:
  * prefill: `context` random tokens in `--chunk`-token chunks, the cache evaluated after each
    chunk as mlx-lm does -> tokens/s and peak memory (every TurboSpark cache, mlx-lm's and own,
    commits `--chunk` rows at once: its max_rows, and q_block of the mlx-lm drop-in);
  * decode, in paired rounds (each round: every row once, so rows are timed seconds apart):
    a synchronous loop (build a step, argmax, `mx.eval`) -> ms/step and host graph-build ms/step;
    mlx-lm's own `generate_step` with a 1-token prompt (builds step n+1 before reading token n)
    -> ms/step, the first step left out; custom-kernel launches per step (`gpu.build.LAUNCHES`,
    graph nodes built); peak memory. Medians over rounds; each row also as a ratio to its
    path's FP16 row (mlx-lm rows vs `mlx-lm fp16`, own rows vs `own fp16`);
  * KV bytes after prefill (`nbytes`).
Peak memory is a row's own: MLX's peak less the active memory other rows' live caches hold (what
the row would peak at alone: weights + its cache + transients). `--one-at-a-time` frees each
row's cache after its rounds (decode rounds are then not interleaved across rows).
Each row is warmed up first (a chunk of prefill and a few decode steps on a throwaway cache).
Writes benchmarks/results/generate_e2e.json and .md (generate_e2e_gemma3.* with --family gemma3).

    python benchmarks/generate_e2e.py                  # on the GPU machine
    python benchmarks/generate_e2e.py --family gemma3  # the Gemma-3-1B shape
    python benchmarks/generate_e2e.py --tiny           # a tiny model on a CPU in seconds: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models import gemma3_text as mlx_lm_gemma3
from mlx_lm.models import llama as mlx_lm_llama

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turbospark_mlx import KVCacheManager, get_preset, make_cache  # noqa: E402
from turbospark_mlx.gpu.backend import auto_backend  # noqa: E402
from turbospark_mlx.gpu.build import LAUNCHES  # noqa: E402
from turbospark_mlx.mlx_lm import make_prompt_cache  # noqa: E402
from turbospark_mlx.models import gemma3_text as own_gemma3  # noqa: E402
from turbospark_mlx.models import llama as own_llama  # noqa: E402

T = TypeVar("T")
Cache = list | KVCacheManager  # mlx-lm's per-layer cache list, or the package's own cache

# Row name -> (path, KV preset); each path's FP16 row is the reference of its ratios.
ROWS = {
    "mlx-lm fp16": ("mlx-lm", "fp16"),
    "mlx-lm tq4": ("mlx-lm", "tq4"),
    "mlx-lm k8v4": ("mlx-lm", "k8v4"),
    "mlx-lm tq3": ("mlx-lm", "tq3"),
    "own fp16": ("own", "fp16"),
    "own tq4": ("own", "tq4"),
    # tq4 without its FP16 window, sink rows and key centring: what the protection costs.
    "own tq4-plain": ("own", get_preset("tq4").plain()),
}
LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
GEMMA3 = dict(model_type="gemma3_text", sliding_window_pattern=6, query_pre_attn_scalar=256)
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size")  # fmt: skip
# Family -> (mlx-lm module, own module, shape name -> config), full shape first, then --tiny's.
FAMILIES = {
    "llama": (mlx_lm_llama, own_llama, {
        "8B": {**LLAMA, **dict(zip(SHAPE_KEYS, (4096, 32, 14336, 32, 8, 128, 128256)))},
        "tiny": {**LLAMA, **dict(zip(SHAPE_KEYS, (128, 2, 256, 4, 2, 32, 512)))},
    }),
    "gemma3": (mlx_lm_gemma3, own_gemma3, {
        "1B": {**GEMMA3, "sliding_window": 512, **dict(zip(SHAPE_KEYS, (1152, 26, 6912, 4, 1, 256, 262144)))},
        "tiny": {**GEMMA3, "sliding_window": 64, "sliding_window_pattern": 3,
                 **dict(zip(SHAPE_KEYS, (128, 3, 256, 4, 1, 64, 512)))},
    }),
}  # fmt: skip
# Metrics given as a ratio to the same path's FP16 row.
RATIO_KEYS = ("prefill_tok_s", "prefill_peak_gb", "decode_sync_ms", "decode_pipelined_ms", "host_build_ms",
              "decode_peak_gb", "kv_bytes")  # fmt: skip


def build_models(family: str, shape: str) -> dict[str, nn.Module]:
    """mlx-lm's model of the family (bf16, 4-bit weights) and the own model sharing its parameter
    arrays."""
    ref, mine, shapes = FAMILIES[family]
    config = shapes[shape]
    mlx_model = ref.Model(ref.ModelArgs.from_dict(config))
    mlx_model.set_dtype(mx.bfloat16)
    nn.quantize(mlx_model, group_size=64, bits=4)
    mx.eval(mlx_model.parameters())
    own = mine.Model(mine.ModelArgs.from_dict(config))
    params = own.sanitize(dict(tree_flatten(mlx_model.parameters())))  # gemma3: drops the tied head
    nn.quantize(own, group_size=64, bits=4)  # same module tree; its own (lazy) weights are never evaluated
    own.load_weights(list(params.items()), strict=True)  # names and shapes checked
    return {"mlx-lm": mlx_model, "own": own}


def new_cache(row: str, models: dict[str, nn.Module], chunk: int) -> Cache:
    path, kv = ROWS[row]
    if path == "own":
        return make_cache(models["own"], kv, max_rows=chunk, dtype=mx.bfloat16)
    if kv == "fp16":
        return mlx_lm_cache.make_prompt_cache(models["mlx-lm"])
    # Rows per commit and per attention call = the prefill chunk (mlx-lm's prefill_step_size, 2048 by
    # default), as the own path's max_rows: the FP16 recent ring of a tq layer is window + max_rows rows.
    return make_prompt_cache(models["mlx-lm"], kv, max_rows=chunk, q_block=chunk)


def cache_arrays(cache: Cache) -> list:
    """What to evaluate after a prefill chunk: mlx-lm's `c.state` per layer (as generate_step
    does), or every storage array of a KVCacheManager (as turbospark_mlx.generate.prefill does)."""
    if isinstance(cache, list):
        return [c.state for c in cache]
    return [a for i in range(cache.n_layers) for a in cache.layer_arrays(i).values()]


def kv_bytes(cache: Cache) -> int:
    return sum(c.nbytes for c in cache) if isinstance(cache, list) else cache.nbytes


def prefill(model: nn.Module, cache: Cache, tokens: mx.array, chunk: int) -> mx.array:
    """Run tokens (1, n) through the model in chunks; returns the greedy next token, (1, 1)."""
    n = tokens.shape[1]
    for s in range(0, n, chunk):
        tok = mx.argmax(model(tokens[:, s : s + chunk], cache=cache)[:, -1], -1)[:, None]
        mx.eval(cache_arrays(cache), tok if s + chunk >= n else [])
    return tok


def decode_sync(model: nn.Module, cache: Cache, tok: mx.array, steps: int) -> tuple[mx.array, dict]:
    """`steps` greedy steps, one `mx.eval` each: mean seconds per step, mean host graph-build
    seconds (model call + argmax, before the eval) and custom-kernel launches of a step."""
    totals, builds, launches = [], [], []
    for _ in range(steps):
        LAUNCHES.clear()
        t0 = time.perf_counter()
        tok = mx.argmax(model(tok, cache=cache)[:, -1], -1)[:, None]
        t1 = time.perf_counter()
        launches.append(sum(LAUNCHES.values()))
        mx.eval(tok)
        totals.append(time.perf_counter() - t0)
        builds.append(t1 - t0)
    stats = {"sync": statistics.mean(totals), "build": statistics.mean(builds)}
    return tok, {**stats, "launches": statistics.median_low(launches)}


def decode_pipelined(model: nn.Module, cache: Cache, tok: mx.array, steps: int) -> tuple[mx.array, float]:
    """Seconds per step of mlx-lm's `generate_step` (it drives the own model too: its forward is
    `model(tokens, cache=cache)`), from the first token read to the last."""
    stamps = []
    for y, _ in generate_step(tok.reshape(-1), model, prompt_cache=cache, max_tokens=steps):
        stamps.append(time.perf_counter())
    mx.synchronize(generation_stream)  # its step after the last token was queued, never read
    return mx.array([[y]]), (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def tracked(held: dict[str, int], row: str, fn: Callable[[], T]) -> tuple[T, float]:
    """fn() and the row's own peak memory while it ran, in GB: MLX's peak less what other rows'
    caches hold. held[row] grows by the active memory fn leaves behind (the row's cache)."""
    mx.synchronize()
    before = mx.get_active_memory()
    others = sum(b for r, b in held.items() if r != row)
    mx.reset_peak_memory()
    out = fn()
    mx.synchronize()
    held[row] = held.get(row, 0) + mx.get_active_memory() - before
    return out, (mx.get_peak_memory() - others) / 1e9


def bench_context(models: dict[str, nn.Module], context: int, args: argparse.Namespace) -> dict:
    """Prefill every row to `context` tokens, then decode in paired rounds; the context's results."""
    tokens = mx.random.randint(0, models["own"].args.vocab_size, (1, context))
    groups = [[r] for r in args.rows] if args.one_at_a_time else [args.rows]
    out: dict[str, dict] = {}
    held: dict[str, int] = {}
    for group in groups:
        caches, toks = {}, {}
        runs = {r: {k: [] for k in ("sync", "build", "launches", "pipe", "peak")} for r in group}
        for r in group:
            model = models[ROWS[r][0]]
            caches[r] = new_cache(r, models, args.chunk)
            t = time.perf_counter()
            toks[r], peak = tracked(held, r, lambda: prefill(model, caches[r], tokens, args.chunk))
            tok_s = context / (time.perf_counter() - t)
            out[r] = {"prefill_tok_s": tok_s, "prefill_peak_gb": peak, "kv_bytes": kv_bytes(caches[r])}
        for _ in range(args.rounds):
            for r in group:
                model = models[ROWS[r][0]]

                def decode() -> dict:
                    toks[r], sync = decode_sync(model, caches[r], toks[r], args.steps)
                    toks[r], pipe = decode_pipelined(model, caches[r], toks[r], args.steps)
                    return {**sync, "pipe": pipe}

                step, peak = tracked(held, r, decode)
                for k, v in {**step, "peak": peak}.items():
                    runs[r][k].append(v)
        for r in group:
            ms = {k: [1e3 * v for v in runs[r][k]] for k in ("sync", "pipe", "build")}
            out[r].update(
                decode_sync_ms=statistics.median(ms["sync"]),
                decode_pipelined_ms=statistics.median(ms["pipe"]),
                host_build_ms=statistics.median(ms["build"]),
                launches_per_step=statistics.median_low(runs[r]["launches"]),
                decode_peak_gb=statistics.median(runs[r]["peak"]),
                rounds={"decode_sync_ms": ms["sync"], "decode_pipelined_ms": ms["pipe"]},
            )
            del caches[r]
            held.pop(r)
        mx.clear_cache()
    for r, m in out.items():
        ref = out.get(f"{ROWS[r][0]} fp16")
        m["vs_fp16"] = {k: m[k] / ref[k] for k in RATIO_KEYS} if ref else None
    print(json.dumps({"context": context, "sync_ms": {r: m["decode_sync_ms"] for r, m in out.items()}}))
    return {"context": context, "rows": out}


def warm_up(models: dict[str, nn.Module], row: str, chunk: int) -> None:
    """Compile what a row runs (kernels are built on first use) on a throwaway cache: two chunks,
    so that a chunk reads codes and the FP16 ring of a protected layer reaches its full size, as
    they do in the measured runs."""
    model = models[ROWS[row][0]]
    cache = new_cache(row, models, chunk)
    tok = prefill(model, cache, mx.random.randint(0, model.args.vocab_size, (1, 2 * chunk)), chunk)
    tok, _ = decode_sync(model, cache, tok, 2)
    decode_pipelined(model, cache, tok, 2)


def markdown(meta: dict, contexts: list[dict]) -> str:
    lines = [
        f"# Whole-model generation, {meta['shape']} {meta['family']} (random 4-bit weights, bf16)",
        "",
        f"Machine: {meta['machine']}; device {meta['device']}; MLX {meta['mlx']}; mlx-lm {meta['mlx_lm']}; "
        f"backend {meta['backend']}; {meta['date']}.",
        f"Command: `{meta['command']}`",
        "",
        f"Prefill in {meta['chunk']}-token chunks; decode {meta['steps']} steps per measurement, median of "
        f"{meta['rounds']} paired rounds. In brackets: the ratio to the same path's FP16 row. Peak memory is "
        f"the row's own (weights {meta['weights_gb']:.3g} GB + its cache + transients). Launches: custom "
        "kernel calls per decode step (0 on a backend without kernels).",
    ]
    cols = (  # metric, header, format, unit
        ("prefill_tok_s", "prefill tok/s", ".0f", 1),
        ("prefill_peak_gb", "prefill peak GB", ".3g", 1),
        ("decode_sync_ms", "decode ms/step (sync)", ".2f", 1),
        ("decode_pipelined_ms", "decode ms/step (pipelined)", ".2f", 1),
        ("host_build_ms", "host build ms/step", ".2f", 1),
        ("decode_peak_gb", "decode peak GB", ".3g", 1),
        ("kv_bytes", "KV MiB (after prefill)", ".2f", 2**20),
    )
    for c in contexts:
        lines += ["", f"## Context {c['context']}", ""]
        lines += ["| row | " + " | ".join(h for _, h, _, _ in cols) + " | launches/step |"]
        lines += ["|---" * (len(cols) + 2) + "|"]
        for r, m in c["rows"].items():
            vs = m["vs_fp16"]
            cells = [format(m[k] / unit, f) + (f" ({vs[k]:.2f}x)" if vs else "") for k, _, f, unit in cols]
            lines.append(f"| {r} | " + " | ".join(cells) + f" | {m['launches_per_step']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="ROW",
                    help=f"rows to run, of: {', '.join(map(repr, ROWS))}")  # fmt: skip
    ap.add_argument("--contexts", nargs="+", type=int, help="prompt tokens (default 4096 32768 131072)")
    ap.add_argument("--chunk", type=int, help="prefill chunk, also tq caches' max_rows (default 2048)")
    ap.add_argument("--steps", type=int, help="decode steps per measurement (default 64; --tiny 4)")
    ap.add_argument("--rounds", type=int, help="paired decode rounds (default 5; --tiny 1)")
    ap.add_argument("--one-at-a-time", action="store_true", help="free each row's cache after its rounds")
    ap.add_argument("--family", choices=list(FAMILIES), default="llama", help="the model (default llama, 8B)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, seconds on a CPU; to a temp dir")
    ap.add_argument("--out", help="path stem of STEM.json / .md (default benchmarks/results/generate_e2e, "
                    "generate_e2e_gemma3 with --family gemma3)")  # fmt: skip
    args = ap.parse_args()
    tiny = {"contexts": [1024], "chunk": 32, "steps": 4, "rounds": 1}
    # 5 rounds of 64 steps: with 3 of 32, two runs of the same code on H100s differed by up to 0.15
    # in a ratio to FP16 (docs/decode_kernels.md), as much as the targets they are read against.
    full = {"contexts": [4096, 32768, 131072], "chunk": 2048, "steps": 64, "rounds": 5}
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.steps < 2 or args.rounds < 1 or args.chunk < 1:
        ap.error("--steps must be >= 2, --rounds and --chunk >= 1")
    results = Path(__file__).resolve().parent / "results"
    real = results / ("generate_e2e" if args.family == "llama" else f"generate_e2e_{args.family}")
    if args.tiny and args.out and Path(args.out).resolve().parent == results:
        ap.error("--tiny never replaces benchmarks/results")

    shape = list(FAMILIES[args.family][2])[1 if args.tiny else 0]
    models = build_models(args.family, shape)
    mx.synchronize()
    meta = {
        "family": args.family,
        "shape": shape,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "device": mx.device_info().get("device_name", str(mx.default_device())),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "backend": auto_backend(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + shlex.join(sys.argv),
        "weights_gb": mx.get_active_memory() / 1e9,
        **{k: getattr(args, k) for k in ("rows", "contexts", "chunk", "steps", "rounds", "one_at_a_time")},
    }
    print(json.dumps(meta), flush=True)
    for r in args.rows:
        warm_up(models, r, args.chunk)
    out = args.out or str(real)
    if args.tiny and not args.out:
        out = str(Path(tempfile.mkdtemp(prefix="generate_e2e_")) / "generate_e2e")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    contexts = []
    for c in args.contexts:  # written after each context, so a run cut short keeps what it measured
        contexts.append(bench_context(models, c, args))
        text = markdown(meta, contexts)
        Path(out + ".json").write_text(json.dumps({"meta": meta, "contexts": contexts}, indent=1))
        Path(out + ".md").write_text(text)
    print(text)
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
