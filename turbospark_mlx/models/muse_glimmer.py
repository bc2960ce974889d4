"""Muse Glimmer (text tower) on the TurboQuant KV cache.

[local x 3, global] layers: local layers use RoPE and a sliding window (FP16
rings), global layers use no positional embedding (NoPE) and are what a
TurboQuant preset compresses. Gated attention output (attn * sigmoid(gate)),
scaleless q/k RMSNorm with Q scaled by `qk_scale_factor`, scaleless RMSNorm
on the embeddings, centred (1 + w) block norms, final logit soft-capping.
Parameter names follow mlx-lm's muse_glimmer (which older mlx-lm lacks, so
this file does not import from it).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCacheManager, LayerSpec
from .base import BaseModelArgs, cache_for_call, cached_attention, not_shardable

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int
    model_type: str = "muse_glimmer"
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    qk_scale_factor: float = 3.87
    hidden_activation: str = "silu"
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rope_parameters: dict | None = None
    layer_types: list[str] | None = None
    layer_rope_theta: list[float] | None = None
    tie_word_embeddings: bool = False
    final_logit_softcapping: float = 20.0
    output_multiplier: float = 0.19611613513818404

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        # Meta's checkpoint nests the text fields under "text_config"; mlx-community's are flat.
        if "text_config" in params:
            params = {**params, **params["text_config"]}
        return super().from_dict(params)

    def __post_init__(self):
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            self.rope_theta = self.rope_parameters["rope_theta"]
        if self.layer_types is None:
            pattern = ["sliding_attention"] * 3 + ["full_attention"]
            self.layer_types = (pattern * (self.num_hidden_layers // 4 + 1))[: self.num_hidden_layers]
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"muse_glimmer: layer_types must list {self.num_hidden_layers} entries from {LAYER_TYPES}, "
                f"got {self.layer_types}"
            )
        if self.layer_rope_theta is None:
            # Global layers run NoPE (theta 0).
            self.layer_rope_theta = [
                0 if t == "full_attention" else self.rope_theta for t in self.layer_types
            ]
        if len(self.layer_rope_theta) != self.num_hidden_layers:
            raise ValueError(f"muse_glimmer: layer_rope_theta must list {self.num_hidden_layers} entries")
        if self.hidden_activation != "silu":
            raise ValueError(
                f"muse_glimmer: hidden_activation {self.hidden_activation!r} is not supported (silu)"
            )


class CenteredRMSNorm(nn.Module):
    """RMSNorm with a zero-centred scale: norm(x) * (1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.layer_idx = layer_idx
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.qk_scale_factor = args.qk_scale_factor
        self.eps = args.rms_norm_eps
        self.layer_type = args.layer_types[layer_idx]
        self.use_rope = bool(args.layer_rope_theta[layer_idx])

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.gate_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        if self.use_rope:
            self.rope = nn.RoPE(self.head_dim, traditional=False, base=args.rope_theta)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        B, L, _ = x.shape
        position = cache.layer_offset(self.layer_idx)
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        # Scaleless QK-norm over head_dim; Q additionally scaled.
        q = (mx.fast.rms_norm(q, None, self.eps) * self.qk_scale_factor).transpose(0, 2, 1, 3)
        k = mx.fast.rms_norm(k, None, self.eps).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        if self.use_rope:
            q = self.rope(q, offset=position)
            k = self.rope(k, offset=position)
        out = cached_attention(cache, self.layer_idx, q, k, v, position, scale=self.scale)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(self.gate_proj(x)))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = CenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(args.hidden_size, args.post_norm_eps)
        self.pre_feedforward_layernorm = CenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = CenteredRMSNorm(args.hidden_size, args.post_norm_eps)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class MuseGlimmerModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: KVCacheManager) -> mx.array:
        # Scaleless RMSNorm on the embeddings (not Gemma's sqrt scaling).
        h = mx.fast.rms_norm(self.embed_tokens(inputs), None, self.args.rms_norm_eps)
        for layer in self.layers:
            h = layer(h, cache)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = MuseGlimmerModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: KVCacheManager | None = None) -> mx.array:
        cache = cache_for_call(self, cache, inputs)
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(out)
        else:
            out = self.lm_head(out)
        out = out * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            if k.startswith(("vision_tower", "vision_adapter", "vision_projection")):
                continue  # text-only port
            # Meta / MLX nest the text tower under language_model.*
            for prefix, new in (
                ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."),
                ("model.language_model.", "model."),
            ):
                if k.startswith(prefix):
                    k = new + k[len(prefix) :]
                    break
            out[k] = v
        return out

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        raise not_shardable("muse_glimmer", "the gated attention output is not split here")

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        raise not_shardable("muse_glimmer", "the gated attention output is not split here")

    @property
    def layers(self):
        return self.model.layers

    @property
    def max_context(self) -> int | None:
        return self.args.max_position_embeddings

    def kv_layer_specs(self) -> list[LayerSpec]:
        a = self.args
        return [
            LayerSpec(
                a.num_key_value_heads,
                a.head_dim,
                window=a.sliding_window if t == "sliding_attention" else None,
            )
            for t in a.layer_types
        ]
