"""The decode benchmark end to end, on CPU: `benchmarks/decode_attention.py --tiny` runs as its
own process (one small shape, the reference attention in place of the GPU kernels) and its
report is checked: each method's paired ratios are the per-round ratios of its timings to
SDPA's, amortized and overlapped, and the markdown shows what the JSON holds."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "decode_attention.py"
pytestmark = pytest.mark.skipif(not BENCH.is_file(), reason="needs the repository's benchmarks/ (not in the sdist)")


def _run_tiny(out: Path) -> tuple[dict, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "decode_attention.json").read_text()), (out / "decode_attention.md").read_text()


def _cells(md: str, section: str, prefix: str) -> list[str]:
    part = md[md.index(section) :] if section else md
    line = next(ln for ln in part.splitlines() if ln.startswith(prefix))
    return [c.strip() for c in line.split("|")[1:-1]]


def test_tiny_run_paired_rounds_and_markdown(tmp_path):
    res, md = _run_tiny(tmp_path)
    meta, rows = res["meta"], res["rows"]
    assert meta["n_chain"] == 2 and meta["copy_GBps"] > 0
    assert len(rows) == 1
    row = rows[0]
    assert row["context"] == 256
    methods = row["methods"]
    for name in ("fp16_sdpa", "fp16_sdpa_mask", "tq4_kernel", "tq3_kernel", "k8v4_kernel"):
        assert methods[name]["amortized_us"] > 0, name

    # The baseline is the median of SDPA's timings in the row, and every ratio is against it.
    base = methods["fp16_sdpa"]
    assert len(base["amortized_runs_us"]) >= 2
    runs = base["amortized_runs_us"]  # rounded to 0.1 us
    assert abs(base["amortized_us"] - statistics.median(runs)) < 0.1 + 1e-3 * base["amortized_us"]
    for name, m in methods.items():
        if "amortized_us" in m:
            assert abs(m["vs_fp16_sdpa"] - m["amortized_us"] / base["amortized_us"]) < 1e-9, name

    # Paired rounds: SDPA is the reference, never a paired method itself.
    assert "paired" not in base
    for name in ("tq4_kernel", "tq3_kernel", "k8v4_kernel"):
        pr = methods[name]["paired"]
        for kind in ("", "overlapped_"):
            ts, sdpa = pr[f"{kind}rounds_us"], pr[f"sdpa_{kind}rounds_us"]
            assert len(ts) == len(sdpa) == 3 and min(ts + sdpa) > 0
            # The stored rounds are rounded to 0.1 us; the ratios come from the unrounded timings.
            ratios = sorted(t / b for t, b in zip(ts, sdpa))
            median = statistics.median(ratios)
            assert abs(pr[f"{kind}vs_fp16_sdpa"] - median) < 0.05 * median + 1e-3, (name, kind)
            lo, hi = pr[f"{kind}vs_fp16_sdpa_range"]
            assert lo <= pr[f"{kind}vs_fp16_sdpa"] <= hi

    # The markdown shows the JSON's numbers.
    shape = row["shape"]
    cells = _cells(md, "", f"| {shape} | 256 | tq4_kernel |")
    assert cells[3] == f"{methods['tq4_kernel']['amortized_us']:.1f}"
    assert cells[7] == f"{methods['tq4_kernel']['vs_fp16_sdpa']:.2f}"
    pr = methods["tq4_kernel"]["paired"]
    cells = _cells(md, "Paired rounds", f"| {shape} | 256 | tq4_kernel |")
    assert cells[4] == f"{pr['vs_fp16_sdpa']:.2f}"
    assert cells[5] == f"{pr['vs_fp16_sdpa_range'][0]:.2f}-{pr['vs_fp16_sdpa_range'][1]:.2f}"
    assert cells[7] == f"{pr['overlapped_vs_fp16_sdpa']:.2f}"
    assert "x FP16 SDPA (overlapped)" in md
    for preset in ("tq4", "tq3", "k8v4"):
        cells = _cells(md, "Commit (tq_quantize", f"| {shape} | {preset} |")
        assert cells[2] == f"{row['commit'][preset]['amortized_us']:.1f}"
    speedup = methods["tq4_kernel"]["speedup_vs_affine4"]
    affine = methods["affine4_mlx_lm_style"]["amortized_us"]
    assert abs(speedup - affine / methods["tq4_kernel"]["amortized_us"]) < 1e-9
    assert f"tq4 {speedup:.2f}x" in md
