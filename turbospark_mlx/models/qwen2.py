"""Qwen2 / Qwen2.5 dense: llama's outline with biased Q/K/V projections (an unbiased O).

Same module tree and weight names as mlx_lm/models/qwen2.py.
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
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: Optional[float] = None
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[dict] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        # transformers >= 5 nests rope_theta and the scaling block under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None and self.rope_parameters.get("rope_type", "default") != "default":
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 1000000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.layer_idx = layer_idx
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim
        self.scale = head_dim**-0.5

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rope = initialize_rope(
            head_dim,
            base=args.rope_theta,
            traditional=args.rope_traditional,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
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
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(PipelineMixin, nn.Module):
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
        self.model = Qwen2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[KVCacheManager] = None) -> mx.array:
        out = self.model(inputs, cache_for_call(self, cache, inputs))
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over `group`, as mlx-lm shards qwen2: each rank keeps 1/N of the query
        and KV heads and of the MLP columns; o_proj and down_proj all-sum the partial outputs."""
        a = self.args
        group = shard_group(
            self,
            "qwen2",
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
        D = self.args.head_dim
        return [None if l is None else LayerSpec(l.self_attn.n_kv_heads, D) for l in self.layers]
