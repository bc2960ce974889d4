"""gpt-oss on the TurboQuant KV cache.

Alternating sliding-window (128) and full layers: sliding layers are FP16
rings, full layers are what a TurboQuant preset compresses. Every layer has
attention sinks (one learned logit per query head in the softmax), which go
through both the FP16 and the TurboQuant attention. The MoE block (top-k
router, SwiGLU experts with gpt-oss's clamped activation) is mlx-lm's
`MLPBlock`; its experts load from MXFP4 checkpoints (OpenAI's `*_blocks` /
`*_scales`, or mlx-community's re-saved ones) as `mx.quantize(mode="mxfp4")`
weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss as _mlx_gpt_oss
from mlx_lm.models.gpt_oss import MLPBlock
from mlx.nn.layers.distributed import shard_inplace
from mlx_lm.models.rope_utils import initialize_rope

from ..cache import KVCacheManager, LayerSpec
from .base import BaseModelArgs, PipelineMixin, cache_for_call, cached_attention, shard_attention_projections, shard_group

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ModelArgs(BaseModelArgs):
    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    sliding_window: int
    model_type: str = "gpt_oss"
    rms_norm_eps: float = 1e-05
    rope_theta: float = 150000
    rope_scaling: Any = None
    max_position_embeddings: int = 131072
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["sliding_attention", "full_attention"] * (self.num_hidden_layers // 2)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"gpt_oss: layer_types must list {self.num_hidden_layers} entries from {LAYER_TYPES}, "
                f"got {self.layer_types}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"gpt_oss: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"gpt_oss: num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_local_experts}]"
            )


class AttentionBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = D = args.head_dim
        self.num_attention_heads = args.num_attention_heads
        self.num_key_value_heads = args.num_key_value_heads
        self.sinks = mx.zeros((args.num_attention_heads,))
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * D, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * D, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * D, bias=True)
        self.o_proj = nn.Linear(args.num_attention_heads * D, args.hidden_size, bias=True)
        self.sm_scale = 1 / math.sqrt(D)
        self.rope = initialize_rope(D, args.rope_theta, traditional=False, scaling_config=args.rope_scaling)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        if self.sinks.shape != (self.num_attention_heads,):
            # Checked before the write, so a bad sink leaves the cache as it was.
            raise ValueError(
                f"gpt_oss layer {self.layer_idx}: sinks must have shape ({self.num_attention_heads},), "
                f"got {tuple(self.sinks.shape)}"
            )
        B, L, _ = x.shape
        D = self.head_dim
        position = cache.layer_offset(self.layer_idx)
        q = self.q_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
        k = self.k_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
        v = self.v_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
        q = self.rope(q, offset=position)
        k = self.rope(k, offset=position)
        out = cached_attention(
            cache, self.layer_idx, q, k, v, position, scale=self.sm_scale, sinks=self.sinks
        )
        return self.o_proj(out.swapaxes(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = AttentionBlock(args, layer_idx)
        self.mlp = MLPBlock(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssMoeModel(PipelineMixin, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]

    def __call__(self, inputs: mx.array, cache: KVCacheManager) -> mx.array:
        x = self.stage_input(self.embed_tokens(inputs))
        for layer in self.pipeline_layers:
            x = layer(x, cache)
        return self.norm(self.stage_output(x, cache))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GptOssMoeModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: KVCacheManager | None = None) -> mx.array:
        cache = cache_for_call(self, cache, inputs)
        return self.lm_head(self.model(inputs, cache))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # mlx-lm's renaming: MXFP4 `*_blocks`/`*_scales` -> weight/scales, fused
        # gate_up split into gate and up (interleaved rows).
        weights = _mlx_gpt_oss.Model.sanitize(self, weights)
        want = (self.args.num_attention_heads,)
        for k, v in weights.items():
            if k.endswith("self_attn.sinks") and tuple(v.shape) != want:
                raise ValueError(
                    f"gpt_oss: {k} has shape {tuple(v.shape)}, expected {want} (one per query head)"
                )
        return weights

    @property
    def quant_predicate(self):
        # The router stays at 8 bits when the rest is quantized, as mlx-lm does.
        return _mlx_gpt_oss.Model.quant_predicate.fget(self)

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor parallel over `group`, as mlx-lm shards gpt-oss: each rank keeps 1/N of the query
        and KV heads (and their sinks) and of every expert's columns; o_proj and the experts'
        down_proj all-sum the partial outputs (the down bias divided by N, so it adds up once)."""
        a = self.args
        group = shard_group(
            self,
            "gpt_oss",
            group,
            num_attention_heads=a.num_attention_heads,
            num_key_value_heads=a.num_key_value_heads,
            intermediate_size=a.intermediate_size,
        )
        N, r = group.size(), group.rank()
        for layer in self.layers:
            if layer is None:  # another pipeline stage's layer
                continue
            attn, experts = layer.self_attn, layer.mlp.experts
            shard_attention_projections(attn, group)
            attn.num_attention_heads //= N
            attn.num_key_value_heads //= N
            h = attn.num_attention_heads
            attn.sinks = attn.sinks[h * r : h * (r + 1)]
            shard_inplace(experts.gate_proj, "all-to-sharded", group=group)
            shard_inplace(experts.up_proj, "all-to-sharded", group=group)
            shard_inplace(experts.down_proj, "sharded-to-all", group=group)
            experts.down_proj.bias /= N
            layer.mlp.sharding_group = group

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        """Pipeline parallel over `group`: this rank keeps its run of layers (`PipelineMixin`)."""
        self.model.pipeline(group, split)

    @property
    def layers(self):
        return self.model.layers

    @property
    def max_context(self) -> int | None:
        return self.args.max_position_embeddings

    def kv_layer_specs(self) -> list[LayerSpec]:
        # Heads as the modules hold them (1/N after `shard`); None: another pipeline stage's layer.
        a = self.args
        return [
            None
            if l is None
            else LayerSpec(
                l.self_attn.num_key_value_heads,
                a.head_dim,
                window=a.sliding_window if t == "sliding_attention" else None,
            )
            for l, t in zip(self.layers, a.layer_types)
        ]
