"""One rank of the multi-rank tests (tests/test_distributed.py), run under `mlx.launch`.

    mlx.launch -n 2 --backend ring --python PYTHON tests/distributed_worker.py OUT_DIR [fail]

For every case in CASES each rank builds the same seeded tiny model as the test's
single-process reference, shards it over the world group (tensor parallel, "tp"), splits
its layers (pipeline, "pp"), or shards an mlx-lm model and gives it the drop-in cache
("mlx_lm"), then generates greedy tokens after a prompt long enough that rows leave the
FP16 window and are quantized. It writes OUT_DIR/rank{r}.json (per case: tokens, KV bytes,
bytes per layer) and OUT_DIR/rank{r}_{case}.npz (the logits of every step and the storage
of the layers it holds).
With `fail`, rank 1 raises in the middle of the first case.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

# Bit-reproducible matmuls, the same as the test process's (tests/conftest.py says why).
os.environ.setdefault("TURBOSPARK_CPU_BLAS", "reference")

import turbospark_mlx as ts  # noqa: E402  isort: skip
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from turbospark_mlx.generate import prefill  # noqa: E402
from turbospark_mlx.models import get_model_classes  # noqa: E402

BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": dict(BASE, model_type="llama", rope_theta=10000.0),
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    # Layers 0, 1, 3, 4 slide over 8 positions (FP16 rings); 2 and 5 are global.
    "gemma3_text": dict(
        BASE,
        model_type="gemma3_text",
        num_hidden_layers=6,
        head_dim=32,
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=32,
    ),
    # MoE (4 experts, 2 per token), sinks; layers 0 and 2 slide over 8 positions.
    "gpt_oss": dict(
        BASE,
        model_type="gpt_oss",
        num_hidden_layers=4,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=32,
        sliding_window=8,
    ),
}
# (mode, family, preset)
CASES = [
    ("tp", "llama", "fp16"),
    ("tp", "llama", "tq4"),
    ("tp", "llama", "k8v4"),
    ("tp", "qwen2", "tq4"),
    ("tp", "qwen3", "k8v4"),
    ("tp", "gemma3_text", "tq4"),
    ("tp", "gpt_oss", "tq4"),
    ("pp", "llama", "fp16"),
    ("pp", "llama", "tq4"),
    ("pp", "qwen3", "k8v4"),
    ("pp", "gemma3_text", "k8v4"),
    ("pp", "gpt_oss", "k8v4"),
    ("mlx_lm", "llama", "tq4"),
    ("mlx_lm", "llama", "k8v4"),
]
PROMPT = 340  # > window_rows + sink_rows + commit_rows (324 for tq4): the oldest rows are stored as codes
NEW_TOKENS = 12
CHUNK = 64  # prefill rows per forward pass: inner chunks evaluate only the cache


def case_name(mode: str, family: str, kv: str) -> str:
    return f"{mode}-{family}-{kv}"


def build(family: str, mlx_lm: bool = False, seed: int = 7) -> nn.Module:
    """The family's tiny model (this package's, or mlx-lm's) with seeded random float32 weights."""
    config = CONFIGS[family]
    if mlx_lm:
        mod = importlib.import_module(f"mlx_lm.models.{family}")
        Model, Args = mod.Model, mod.ModelArgs
    else:
        Model, Args = get_model_classes(config["model_type"])
    mx.random.seed(seed)
    model = Model(Args.from_dict(config))
    # Wider than the default init, so the layers do real work.
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    mx.eval(model.parameters())
    return model


def prompt_tokens() -> mx.array:
    return mx.array(np.random.default_rng(3).integers(0, 128, size=(1, PROMPT)))


def greedy(
    model: nn.Module, kv: str, mlx_lm: bool = False, after_prefill=None
) -> tuple[list[int], mx.array, object]:
    """NEW_TOKENS greedy tokens after the prompt; returns (tokens, the logits they were picked
    from (NEW_TOKENS, vocab), cache)."""
    x = prompt_tokens()
    if mlx_lm:
        from turbospark_mlx.mlx_lm import make_prompt_cache

        cache = make_prompt_cache(model, kv=kv)
        logits = model(x, cache=cache)[:, -1]
    else:
        cache = ts.make_cache(model, kv=kv, max_rows=CHUNK)
        logits = prefill(model, cache, x, prefill_step_size=CHUNK)
    if after_prefill is not None:
        after_prefill()
    out, steps = [], [logits]
    for i in range(NEW_TOKENS):
        y = mx.argmax(steps[-1], axis=-1)
        out.append(y.item())
        if i + 1 < NEW_TOKENS:
            steps.append(model(y.reshape(1, 1), cache=cache)[:, -1])
    return out, mx.concatenate(steps, axis=0), cache


def layer_bytes(cache, mlx_lm: bool) -> dict[int, int]:
    """KV bytes of each layer the cache holds (a TurboSpark layer of the drop-in list: its nbytes)."""
    if mlx_lm:
        return {i: c.nbytes for i, c in enumerate(cache)}
    return {i: cache.layer_nbytes(i) for i in cache.owned_layers()}


def layer_arrays(cache, mlx_lm: bool) -> dict[str, np.ndarray]:
    """Storage arrays of every layer the cache holds, as "layer.name" -> numpy."""
    if mlx_lm:
        items = {i: c._arrays() for i, c in enumerate(cache)}
    else:
        items = {i: l.arrays for i, l in cache.owned_layers().items()}
    return {f"{i}.{name}": np.array(a) for i, arrays in items.items() for name, a in arrays.items() if a.size}


def run_case(group, mode: str, family: str, kv: str, after_prefill=None) -> tuple[dict, dict]:
    mlx_lm = mode == "mlx_lm"
    model = build(family, mlx_lm=mlx_lm)
    if mode == "pp":
        model.pipeline(group)
    else:
        model.shard(group)
    tokens, logits, cache = greedy(model, kv, mlx_lm=mlx_lm, after_prefill=after_prefill)
    nbytes = sum(c.nbytes for c in cache) if mlx_lm else cache.nbytes
    arrays = layer_arrays(cache, mlx_lm)
    arrays["logits"] = np.array(logits)
    return {"tokens": tokens, "nbytes": nbytes, "layer_nbytes": layer_bytes(cache, mlx_lm)}, arrays


def main(out_dir: Path, fail: bool) -> None:
    group = mx.distributed.init(strict=True)
    rank = group.rank()

    def fail_here():
        if fail and rank == 1:
            raise RuntimeError("rank 1 fails on purpose in the middle of a generation")

    results = {}
    for n, (mode, family, kv) in enumerate(CASES):
        name = case_name(mode, family, kv)
        results[name], arrays = run_case(group, mode, family, kv, after_prefill=fail_here if n == 0 else None)
        np.savez(out_dir / f"rank{rank}_{name}.npz", **arrays)
    results["size"] = group.size()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), fail=sys.argv[2:] == ["fail"])
