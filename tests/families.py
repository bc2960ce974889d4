"""Tiny configs and helpers for the sliding-window / sink / shared-KV family tests and benchmark.

Each family: its turbospark module, the mlx-lm module of the same name (the
parity reference), and a tiny config that exercises what differs (window 8 or
16, global layers, shared KV, sinks, MoE).
"""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
from mlx.utils import tree_flatten

GEMMA4_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
}

CONFIGS = {
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=32,
    ),
    "gemma4_text": dict(
        model_type="gemma4_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        vocab_size=128,
        vocab_size_per_layer_input=128,
        sliding_window=8,
        sliding_window_pattern=3,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        rope_parameters=GEMMA4_ROPE,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        sliding_window=8,
    ),
    "muse_glimmer": dict(
        model_type="muse_glimmer",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        sliding_window=8,
        qk_scale_factor=2.0,
    ),
}
FAMILIES = list(CONFIGS)

# Smallest layouts with both layer kinds (and gemma4's shared layers), window 16,
# for the long-generation test and benchmark: decode cost here is per-op overhead.
LONG_CONFIGS = {
    "gemma3_text": {
        **CONFIGS["gemma3_text"],
        "num_hidden_layers": 2,
        "sliding_window_pattern": 2,
        "sliding_window": 16,
    },
    "gemma4_text": {
        **CONFIGS["gemma4_text"],
        "num_hidden_layers": 4,
        "sliding_window_pattern": 2,
        "sliding_window": 16,
        "enable_moe_block": False,
    },
    "gpt_oss": {**CONFIGS["gpt_oss"], "num_hidden_layers": 2, "sliding_window": 16},
    "muse_glimmer": {
        **CONFIGS["muse_glimmer"],
        "num_hidden_layers": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def modules(family: str):
    """(turbospark module, mlx-lm module) of a family."""
    return (
        importlib.import_module(f"turbospark_mlx.models.{family}"),
        importlib.import_module(f"mlx_lm.models.{family}"),
    )


def random_params(model, seed: int = 0) -> dict[str, mx.array]:
    """Random float parameters for `model`; norms, sinks and scales too, so they matter."""
    mx.random.seed(seed)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            out[name] = p
            continue
        std = 1.0 if name.endswith("sinks") else (0.3 if p.ndim == 1 else 1 / math.sqrt(p.shape[-1]))
        out[name] = (std * mx.random.normal(p.shape)).astype(p.dtype)
    return out


def pair(family: str, config: dict | None = None, seed: int = 0):
    """(mlx-lm model, turbospark model) with the same random weights."""
    mine, ref = modules(family)
    config = config or CONFIGS[family]
    ref_model = ref.Model(ref.ModelArgs.from_dict(config))
    params = random_params(ref_model, seed)
    ref_model.load_weights(list(params.items()))
    model = mine.Model(mine.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize(params).items()))
    mx.eval(ref_model.parameters(), model.parameters())
    return ref_model, model


def greedy(model, prompt: mx.array, steps: int, cache) -> mx.array:
    """A tiny greedy decode loop (tests and benchmarks only): prompt (1, L) -> the tokens produced."""
    logits = model(prompt, cache=cache)
    tok = mx.argmax(logits[:, -1], axis=-1)
    out = [tok]
    for _ in range(steps - 1):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        out.append(tok)
    return mx.concatenate(out)
