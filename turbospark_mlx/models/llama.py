"""Llama family: Llama 2 / 3 / 3.1 / 3.2 (llama3 RoPE scaling), SmolLM, Mistral (remapped here).

Same module tree and weight names as mlx_lm/models/llama.py, so the same
checkpoints load; attention goes through the TurboQuant-aware cache write path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from ..cache import KVCacheManager, LayerSpec
from .base import BaseModelArgs, PipelineMixin, cache_for_call, cached_attention, shard_blocks, shard_group


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: Optional[float] = None
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[dict] = None
    tie_word_embeddings: bool = True
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # transformers >= 5 nests rope_theta and the scaling block under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None and self.rope_parameters.get("rope_type", "default") != "default":
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 10000.0
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.layer_idx = layer_idx
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        bias = args.attention_bias

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.rope = initialize_rope(
            head_dim,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, Hq, L, D)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, Hkv, L, D)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

        # RoPE offset is this layer's committed length, read before the write.
        offset = cache.layer_offset(self.layer_idx)
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
        out = cached_attention(cache, self.layer_idx, queries, keys, values, offset, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden_dim, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.use_sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(PipelineMixin, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: KVCacheManager) -> mx.array:
        h = self.stage_input(self.embed_tokens(inputs))
        for layer in self.pipeline_layers:
            h = layer(h, cache)
        return self.norm(self.stage_output(h, cache))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[KVCacheManager] = None) -> mx.array:
        out = self.model(inputs, cache_for_call(self, cache, inputs))
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def sanitize(self, weights: dict) -> dict:
        # Precomputed rotary frequencies are not parameters here.
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`, as mlx-lm shards llama: each rank keeps 1/N of the query
        and KV heads and of the MLP columns; o_proj and down_proj all-sum the partial outputs."""
        a = self.args
        group = shard_group(
            self,
            "llama",
            group,
            num_attention_heads=a.num_attention_heads,
            num_key_value_heads=a.num_key_value_heads,
            intermediate_size=a.intermediate_size,
        )
        shard_blocks(self.layers, group)

    def pipeline(self, group: mx.distributed.Group, split: Optional[List[int]] = None) -> None:
        """Pipeline parallel over `group`: this rank keeps its run of layers (`PipelineMixin`)."""
        self.model.pipeline(group, split)

    @property
    def layers(self):
        return self.model.layers

    @property
    def max_context(self) -> Optional[int]:
        return self.args.max_position_embeddings

    def kv_layer_specs(self) -> list[LayerSpec]:
        # Heads as the modules hold them (1/N after `shard`); None: another pipeline stage's layer.
        a = self.args
        windows = [a.sliding_window if t == "sliding_attention" else None for t in a.layer_types]
        return [
            None if l is None else LayerSpec(l.self_attn.n_kv_heads, a.head_dim, window=w)
            for l, w in zip(self.layers, windows)
        ]
