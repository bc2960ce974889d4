"""Gemma 4 (text) on the TurboQuant KV cache.

What the cache sees:
  * sliding layers (head_dim) are FP16 rings; full-attention layers have their
    own head_dim (`global_head_dim`, 512 on the real models) and partial
    RoPE, and are what a TurboQuant preset compresses;
  * the last `num_kv_shared_layers` layers own no KV: each reads the cache of
    the last earlier layer of its type (`LayerSpec.shared_from`), so whether
    that KV is compressed is decided once, for the owner;
  * `attention_k_eq_v` (full layers of the larger models): V comes from the
    K projection. K and V are still stored separately, because they differ
    once stored: K = RoPE(k_norm(x W_k)) while V = v_norm(x W_k) (scaleless
    norm, no RoPE).
Also per-layer input embeddings and the optional MoE block. MLP, router and
experts are mlx-lm's own modules (same parameter names, same math).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as _mlx_gemma4
from mlx_lm.models.gemma4_text import MLP, Experts, RMSNormNoScale, Router, logit_softcap
from mlx_lm.models.rope_utils import initialize_rope

from ..cache import KVCacheManager, LayerSpec
from .base import BaseModelArgs, cache_for_call, cached_attention, not_shardable, written_attention

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    sliding_window: int
    head_dim: int = 256  # HF's default, which multimodal configs rely on
    model_type: str = "gemma4_text"
    global_head_dim: int | None = None
    global_partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    vocab_size_per_layer_input: int = 262144
    num_global_key_value_heads: int | None = None
    num_kv_shared_layers: int = 0
    pad_token_id: int = 0
    hidden_size_per_layer_input: int = 0
    rope_traditional: bool = False
    partial_rotary_factor: float = 1.0
    rope_parameters: dict | None = None
    sliding_window_pattern: int = 5
    max_position_embeddings: int = 131072
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = 30.0
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.rope_parameters is None:
            self.rope_parameters = {
                "full_attention": {
                    "partial_rotary_factor": self.global_partial_rotary_factor,
                    "rope_theta": 1000000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {
                    "partial_rotary_factor": 1.0,
                    "rope_theta": 10000.0,
                    "rope_type": "default",
                },
            }
        if self.layer_types is None:
            pattern = ["sliding_attention"] * (self.sliding_window_pattern - 1) + ["full_attention"]
            self.layer_types = (pattern * (self.num_hidden_layers // len(pattern) + 1))[
                : self.num_hidden_layers
            ]
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"gemma4: layer_types must list {self.num_hidden_layers} entries from {LAYER_TYPES}, "
                f"got {self.layer_types}"
            )
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ValueError(
                f"gemma4: num_kv_shared_layers={self.num_kv_shared_layers} must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers})"
            )
        owners = set(self.layer_types[: self.first_kv_shared])
        for i in range(self.first_kv_shared, self.num_hidden_layers):
            if self.layer_types[i] not in owners:
                raise ValueError(
                    f"gemma4: KV-shared layer {i} ({self.layer_types[i]}) has no earlier layer to read"
                )
        if self.enable_moe_block and None in (
            self.num_experts,
            self.top_k_experts,
            self.moe_intermediate_size,
        ):
            raise ValueError(
                "gemma4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
            )

    @property
    def first_kv_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_owner(self, layer: int) -> int:
        """The layer whose KV `layer` reads: itself, or the last non-shared layer of its type."""
        if layer < self.first_kv_shared:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_kv_shared) if self.layer_types[i] == kind)

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of `layer`: full layers may have their own."""
        full = self.layer_types[layer] == "full_attention"
        head_dim = self.global_head_dim if full and self.global_head_dim else self.head_dim
        kv_heads = self.num_key_value_heads
        if full and self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            kv_heads = self.num_global_key_value_heads
        return kv_heads, head_dim


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = args.layer_types[layer_idx]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.has_kv = layer_idx < args.first_kv_shared
        self.n_kv_heads, self.head_dim = args.layer_kv_shape(layer_idx)
        self.n_heads = args.num_attention_heads
        self.use_k_eq_v = args.attention_k_eq_v and not self.is_sliding
        self.scale = 1.0  # q and k are RMS-normalised; Gemma 4 attends unscaled
        dim = args.hidden_size

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        if self.has_kv:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
            if not self.use_k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        if self.has_kv:
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.v_norm = RMSNormNoScale(self.head_dim, eps=args.rms_norm_eps)

        rope_params = args.rope_parameters.get(self.layer_type, {})
        self.rope = initialize_rope(
            dims=self.head_dim,
            traditional=args.rope_traditional,
            base=rope_params.get("rope_theta", 10000.0),
            scaling_config=rope_params,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        if not self.has_kv:
            # The owner layer already committed this block's KV.
            position = cache.layer_offset(self.layer_idx) - L
            q = self.rope(q, offset=position)
            out = written_attention(cache, self.layer_idx, q, scale=self.scale)
        else:
            position = cache.layer_offset(self.layer_idx)
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            v = k if self.use_k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=position)
            v = self.v_norm(v).transpose(0, 2, 1, 3)
            q = self.rope(q, offset=position)
            out = cached_attention(cache, self.layer_idx, q, k, v, position, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args, layer_idx)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.enable_moe = args.enable_moe_block
        if self.enable_moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dim, eps=eps)
        self.has_per_layer_input = bool(args.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: KVCacheManager, per_layer_input: mx.array | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        if self.enable_moe:
            dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
            top_k_indices, top_k_weights = self.router(h)
            sparse = self.experts(self.pre_feedforward_layernorm_2(h), top_k_indices, top_k_weights)
            r = dense + self.post_feedforward_layernorm_2(sparse)
        else:
            r = self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(r)
        if self.has_per_layer_input:
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_scale = args.hidden_size**0.5
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        n, d = args.num_hidden_layers, args.hidden_size_per_layer_input
        if d:
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * d)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * d, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def _per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        """(B, L, layers, d): a per-layer token embedding mixed with a projection of h."""
        n, d = self.args.num_hidden_layers, self.args.hidden_size_per_layer_input
        from_tokens = mx.unflatten(self.embed_tokens_per_layer(inputs) * d**0.5, -1, (n, d))
        projected = self.per_layer_model_projection(h) * self.args.hidden_size**-0.5
        projected = self.per_layer_projection_norm(mx.unflatten(projected, -1, (n, d)))
        return (projected + from_tokens) * 2.0**-0.5

    def __call__(self, inputs: mx.array, cache: KVCacheManager) -> mx.array:
        h = self.embed_tokens(inputs) * self.embed_scale
        per_layer = self._per_layer_inputs(inputs, h) if self.args.hidden_size_per_layer_input else None
        for i, layer in enumerate(self.layers):
            h = layer(h, cache, None if per_layer is None else per_layer[:, :, i, :])
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma4TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: KVCacheManager | None = None) -> mx.array:
        cache = cache_for_call(self, cache, inputs)
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(out)
        else:
            out = self.lm_head(out)
        if self.args.final_logit_softcapping is not None:
            out = logit_softcap(self.args.final_logit_softcapping, out)
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # mlx-lm's renaming (expert splits, dropped rotary/clip tensors), then
        # drop K/V projections of KV-shared layers, which older mlx-lm keeps.
        weights = _mlx_gemma4.Model.sanitize(self, weights)
        shared = tuple(
            f"layers.{i}.self_attn.{p}"
            for i in range(self.args.first_kv_shared, self.args.num_hidden_layers)
            for p in ("k_proj.", "v_proj.", "k_norm.")
        )
        return {k: v for k, v in weights.items() if not any(s in k for s in shared)}

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        raise not_shardable("gemma4_text", "KV sharing, K=V attention and MoE experts are not split here")

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        raise not_shardable("gemma4_text", "KV sharing, K=V attention and MoE experts are not split here")

    @property
    def layers(self):
        return self.model.layers

    @property
    def max_context(self) -> int | None:
        return self.args.max_position_embeddings

    def kv_layer_specs(self) -> list[LayerSpec]:
        a = self.args
        specs = []
        for i in range(a.num_hidden_layers):
            owner = a.kv_owner(i)
            window = a.sliding_window if a.layer_types[i] == "sliding_attention" else None
            specs.append(
                LayerSpec(*a.layer_kv_shape(i), window=window, shared_from=None if owner == i else owner)
            )
        return specs
