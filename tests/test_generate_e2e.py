"""The whole-model generation benchmark end to end, on CPU: `benchmarks/generate_e2e.py --tiny` runs
as its own process (a 2-layer llama, a 1024-token prompt, longer than any preset's FP16 window, every
row) and its report is checked: every row is there with positive timings, launches are counted as
integers, the compressed rows hold fewer KV bytes than their path's FP16 row, ratios are against that
row, and the markdown shows the JSON."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "generate_e2e.py"
pytestmark = pytest.mark.skipif(
    not BENCH.is_file(), reason="needs the repository's benchmarks/ (not in the sdist)"
)

ROWS = ("mlx-lm fp16", "mlx-lm tq4", "mlx-lm k8v4", "mlx-lm tq3", "own fp16", "own tq4", "own tq4-plain")


def _tiny(*extra: str):
    """One `--tiny` run without --out: it must write to a temp dir, never to benchmarks/results."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", *extra],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    stem = Path(re.search(r"^wrote (.+)\.json and \.md$", run.stdout, re.M).group(1))
    try:
        assert (ROOT / "benchmarks" / "results") not in stem.resolve().parents
        res = json.loads(stem.with_suffix(".json").read_text())
        yield res, stem.with_suffix(".md").read_text(), run.stdout
    finally:
        shutil.rmtree(stem.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_run():
    yield from _tiny()


def test_every_row_measured(tiny_run):
    res, _, _ = tiny_run
    meta = res["meta"]
    assert meta["shape"] == "tiny" and meta["contexts"] == [1024] and meta["rounds"] == 1
    assert meta["mlx"] and meta["mlx_lm"] and meta["device"] and "--tiny" in meta["command"]
    (ctx,) = res["contexts"]
    assert ctx["context"] == 1024 and tuple(ctx["rows"]) == ROWS
    for name, m in ctx["rows"].items():
        timings = ("prefill_tok_s", "decode_sync_ms", "decode_pipelined_ms")
        for key in (*timings, "prefill_peak_gb", "decode_peak_gb"):
            assert m[key] > 0, (name, key)
        # The host build is part of each synchronous step.
        assert 0 < m["host_build_ms"] < m["decode_sync_ms"], name
        assert len(m["rounds"]["decode_sync_ms"]) == 1
        assert isinstance(m["launches_per_step"], int) and m["launches_per_step"] >= 0, name
        if meta["backend"] != "reference" and "tq" in name:  # a GPU build runs the decode kernels
            assert m["launches_per_step"] > 0, name
        assert isinstance(m["kv_bytes"], int) and m["kv_bytes"] > 0, name


def test_compressed_rows_against_their_fp16_row(tiny_run):
    res, _, _ = tiny_run
    rows = res["contexts"][0]["rows"]
    for name, m in rows.items():
        ref = rows[f"{name.split()[0]} fp16"]
        if name.endswith("fp16"):
            assert all(v == 1.0 for v in m["vs_fp16"].values()), name
            continue
        assert m["kv_bytes"] < ref["kv_bytes"], name
        for key, ratio in m["vs_fp16"].items():
            assert ratio == pytest.approx(m[key] / ref[key]), (name, key)


def test_markdown_shows_the_json(tiny_run):
    res, md, stdout = tiny_run
    assert res["meta"]["command"] in md and f"mlx-lm {res['meta']['mlx_lm']}" in md
    assert "## Context 1024" in md and md in stdout
    for name, m in res["contexts"][0]["rows"].items():
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {name} |"))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[3] == f"{m['decode_sync_ms']:.2f} ({m['vs_fp16']['decode_sync_ms']:.2f}x)"
        assert cells[-1] == str(m["launches_per_step"])


def test_gemma3_family_rows():
    """`--family gemma3`: mlx-lm's gemma3_text and the own one on the same weights (loaded with
    strict=True), sliding rings in every row; every row measured, and the compressed rows hold
    fewer KV bytes than their path's FP16 row."""
    for res, md, _ in _tiny("--family", "gemma3"):
        meta = res["meta"]
        assert (meta["family"], meta["shape"]) == ("gemma3", "tiny") and "tiny gemma3" in md
        rows = res["contexts"][0]["rows"]
        assert tuple(rows) == ROWS
        for name, m in rows.items():
            assert m["decode_sync_ms"] > 0 and m["prefill_tok_s"] > 0, name
            if not name.endswith("fp16"):
                assert m["kv_bytes"] < rows[f"{name.split()[0]} fp16"]["kv_bytes"], name
