"""The real-model benchmarks' results files: `quality.py --merge` and `passkey.py --merge` replace
the runs a new process measures and keep the others, and a passkey probe of some trials cannot
land in the results file. (The benchmarks themselves need the real models; these check the files'
rules on rows made here.)"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
pytestmark = pytest.mark.skipif(
    not (BENCHMARKS / "passkey.py").is_file(), reason="needs the repository's benchmarks/ (not in the sdist)"
)


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import passkey
        import quality

        yield quality, passkey
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_quality_merge_replaces_the_runs_measured_and_keeps_the_order(bench):
    quality, _ = bench
    row = lambda model, run, tag: {"model": f"/m/{model}.gguf", "run": run, "command": tag}  # noqa: E731
    old = [row("a", "1k", "old"), row("a", "8k", "old"), row("b", "1k", "old"), row("b", "8k", "old")]
    new = [row("b", "1k", "new"), row("a", "1k", "new")]
    got = [(r["model"], r["run"], r["command"]) for r in quality.merged(old, new)]
    assert got == [
        ("/m/a.gguf", "1k", "new"), ("/m/a.gguf", "8k", "old"),
        ("/m/b.gguf", "1k", "new"), ("/m/b.gguf", "8k", "old"),
    ]  # fmt: skip
    # A model the file did not hold joins after the others.
    got = quality.merged(old, [row("c", "8k-heldout", "new")])
    assert [(r["model"], r["run"]) for r in got][-1] == ("/m/c.gguf", "8k-heldout") and len(got) == 5


def test_quality_merge_of_presets_joins_the_run_on_the_same_fp16_baseline(bench):
    quality, _ = bench
    row = lambda preset, ppl: {"preset": preset, "perplexity": ppl}  # noqa: E731
    base = {"model": "/m/a.gguf", "run": "8k", "command": "whole", "date": "d1", "seconds": 9.0,
            "results": [row("fp16", 10.0), row("k8v4", 10.1), row("tq4", 10.2), row("tq2", 12.0)]}  # fmt: skip
    new = {"model": "/m/a.gguf", "run": "8k", "command": "more", "date": "d2", "seconds": 3.0,
           "results": [row("fp16", 10.0), row("tq2", 11.0), row("k4v3", 10.3)]}  # fmt: skip
    (got,) = quality.merged([base], [new], presets_only=True)
    # The run's declared order (k4v3 between tq4 and tq2), the new tq2 replacing the old one.
    assert [(x["preset"], x["perplexity"]) for x in got["results"]] == [
        ("fp16", 10.0), ("k8v4", 10.1), ("tq4", 10.2), ("k4v3", 10.3), ("tq2", 11.0),
    ]  # fmt: skip
    assert got["command"] == "whole" and got["added"][0]["presets"] == ["tq2", "k4v3"]
    assert quality._ran(got, "command") == ["whole", "more"] and quality._ran(got, "date") == ["d1", "d2"]
    # Without --presets the new run replaces the old one whole.
    assert quality.merged([base], [new]) == [new]
    # Another FP16 baseline (other tokens, another machine) cannot be mixed in.
    new["results"][0] = row("fp16", 10.5)
    with pytest.raises(SystemExit, match="FP16 perplexity 10.500000 differs"):
        quality.merged([base], [new], presets_only=True)


def test_quality_runs_every_compressed_preset(bench):
    quality, _ = bench
    import turbospark_mlx as ts

    run = quality.RUNS["1k"]
    assert set(quality.SHIPPED) == set(ts.PRESETS) - {"fp16"}
    assert set(run.presets) == {p for n in quality.SHIPPED for p in (n, f"{n}-plain")}
    assert all(set(quality.SHIPPED) <= set(quality.RUNS[r].presets) for r in ("8k", "8k-heldout"))


def test_passkey_merge_keys_rows_by_model_context_and_preset(bench):
    _, passkey = bench
    trial = {"depth": 0.5, "key": "12345", "answer": " 12345.", "hit": True, "margin": 1.25}
    meta = {"machine": "x86_64 cpu", "mlx": "0", "date": "d", "depths": 1}

    def row(model, context, preset, command):
        return {"model": model, "context": context, "preset": preset, "hits": 1, "trials": [trial],
                "command": command, **meta}  # fmt: skip

    old = [row("a", 8192, "fp16", "one"), row("a", 8192, "tq4", "one"), row("a", 16384, "fp16", "one")]
    new = [row("a", 8192, "tq4", "two"), row("a", 8192, "k8v4", "two")]
    got = passkey.merged(old, new)
    assert [(r["context"], r["preset"], r["command"]) for r in got] == [
        (8192, "fp16", "one"), (8192, "tq4", "two"), (8192, "k8v4", "two"), (16384, "fp16", "one"),
    ]  # fmt: skip
    md = passkey.markdown(got)
    assert md.count("## a at 8192 tokens") == 1 and "| tq4 | 1/1 | depth 0.50: '12345.' (+1.25) |" in md
    assert "`two` (tq4, k8v4)" in md and "`one` (fp16)" in md


def test_passkey_refuses_a_subset_of_trials_in_the_results_file():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "passkey.py"), "--only", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--only runs some of the trials" in run.stderr
