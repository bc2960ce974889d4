"""The decode benchmark's paired rounds and report, on CPU with stand-in methods (the benchmark
itself needs a GPU backend for its kernels): each method's ratios are the per-round ratios of
its timings to SDPA's, both amortized and overlapped, and the markdown shows them."""

import importlib.util
import statistics
from pathlib import Path

import mlx.core as mx

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_attention.py"


def _bench():
    spec = importlib.util.spec_from_file_location("decode_attention_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_rounds_and_markdown():
    da = _bench()
    q0 = mx.random.normal((1, 8, 1, 64))
    k = mx.random.normal((1, 2, 256, 64))
    mx.eval(q0, k)
    fns = {
        "fp16_sdpa": lambda q: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125),
        "tq4_kernel": lambda q: q * 0.5 + 1.0,
    }
    methods = {n: {} for n in ("fp16_sdpa", "tq4_kernel", "tq3_kernel", "k8v4_kernel")}
    row = {"shape": "toy", "context": 256, "methods": methods}
    da.paired_rounds(row, fns, q0, n_chain=2, rounds=3)

    pr = methods["tq4_kernel"]["paired"]
    assert "paired" not in methods["fp16_sdpa"]
    for kind in ("", "overlapped_"):
        ts, base = pr[f"{kind}rounds_us"], pr[f"sdpa_{kind}rounds_us"]
        assert len(ts) == len(base) == 3 and min(ts + base) > 0
        ratios = sorted(t / b for t, b in zip(ts, base))
        # The stored rounds are rounded to 0.1 us; the ratios come from the unrounded timings.
        median = statistics.median(ratios)
        assert abs(pr[f"{kind}vs_fp16_sdpa"] - median) < 0.05 * median + 1e-3
        lo, hi = pr[f"{kind}vs_fp16_sdpa_range"]
        assert lo <= pr[f"{kind}vs_fp16_sdpa"] <= hi

    for m in methods.values():
        m.update(amortized_us=1.0, single_eval_us=2.0, bytes=1e6, GBps=1.0, vs_fp16_sdpa=1.0)
    meta = dict(
        device="cpu", mlx=mx.__version__, backend="cpu", date="-", n_chain=2, command="-", copy_GBps=1.0
    )
    md = da.markdown(meta, [row])
    paired_md = md[md.index("Paired rounds") :]
    line = next(ln for ln in paired_md.splitlines() if ln.startswith("| toy | 256 | tq4_kernel |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[4] == f"{pr['vs_fp16_sdpa']:.2f}"
    assert cells[7] == f"{pr['overlapped_vs_fp16_sdpa']:.2f}"
    assert "x FP16 SDPA (overlapped)" in md
