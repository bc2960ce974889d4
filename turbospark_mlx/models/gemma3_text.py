"""Gemma 3 (text) on the TurboQuant KV cache.

Five sliding-window layers to one global layer: the sliding layers are FP16
rings bounded by the window, the global layers are what a TurboQuant preset
compresses. q/k RMSNorm, `query_pre_attn_scalar`, embeddings scaled by
sqrt(hidden), (1 + w) norms, GELU-tanh MLP, separate local and global RoPE
bases. The MLP, norm and residual clip are mlx-lm's own (same parameter
names, same math); attention goes through the cache's write path.

Also loads from GGUF (llama.cpp's `gemma3` architecture) through
`turbospark_mlx.load`; `gguf_config_defaults` fills what llama.cpp leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import MLP, RMSNorm, clip_residual
from mlx_lm.models.rope_utils import initialize_rope

from ..cache import KVCacheManager, LayerSpec
from .base import BaseModelArgs, PipelineMixin, cache_for_call, cached_attention, shard_blocks, shard_group


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
    model_type: str = "gemma3_text"
    rms_norm_eps: float = 1.0e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256
    sliding_window_pattern: int = 6
    max_position_embeddings: int = 32768
    rope_scaling: dict | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"gemma3: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.sliding_window_pattern < 1 or self.sliding_window < 1:
            raise ValueError("gemma3: sliding_window and sliding_window_pattern must be >= 1")

    def is_sliding(self, layer: int) -> bool:
        # Every sliding_window_pattern-th layer is global; the rest slide.
        return (layer + 1) % self.sliding_window_pattern != 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.layer_idx = layer_idx
        self.scale = args.query_pre_attn_scalar**-0.5

        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)

        self.is_sliding = args.is_sliding(layer_idx)
        if self.is_sliding:
            self.rope = initialize_rope(head_dim, base=args.rope_local_base_freq, traditional=False)
        else:
            self.rope = initialize_rope(
                head_dim,
                base=args.rope_theta,
                traditional=False,
                max_position_embeddings=args.max_position_embeddings,
                scaling_config=args.rope_scaling,
            )

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        B, L, _ = x.shape
        position = cache.layer_offset(self.layer_idx)
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(self.q_norm(q), offset=position)
        k = self.rope(self.k_norm(k), offset=position)
        out = cached_attention(cache, self.layer_idx, q, k, v, position, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCacheManager) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), cache)
        h = clip_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return clip_residual(h, self.post_feedforward_layernorm(r))


class Gemma3Model(PipelineMixin, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self, inputs: mx.array, cache: KVCacheManager, input_embeddings: mx.array | None = None
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        # The sqrt(hidden) scale is rounded through bfloat16, as Gemma was trained.
        h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        h = self.stage_input(h)
        for layer in self.pipeline_layers:
            h = layer(h, cache)
        return self.norm(self.stage_output(h, cache))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_word_embeddings = False

    def __call__(
        self,
        inputs: mx.array,
        cache: KVCacheManager | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        cache = cache_for_call(self, cache, inputs)
        out = self.model(inputs, cache, input_embeddings)
        if self.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Gemma 3 checkpoints tie the output head to the embeddings.
        if "lm_head.weight" not in weights:
            self.tie_word_embeddings = True
            if "lm_head" in self:
                self.pop("lm_head")
        return weights

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor parallel over `group`, llama's way: each rank keeps 1/N of the query and KV
        heads and of the MLP columns; o_proj and down_proj all-sum the partial outputs."""
        a = self.args
        group = shard_group(
            self,
            "gemma3_text",
            group,
            num_attention_heads=a.num_attention_heads,
            num_key_value_heads=a.num_key_value_heads,
            intermediate_size=a.intermediate_size,
        )
        shard_blocks(self.layers, group)

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
        windows = [a.sliding_window if a.is_sliding(i) else None for i in range(a.num_hidden_layers)]
        return [
            None if l is None else LayerSpec(l.self_attn.n_kv_heads, a.head_dim, window=w)
            for l, w in zip(self.layers, windows)
        ]


# -- GGUF (llama.cpp `gemma3` architecture) -------------------------------------
# Tensor names and stored config keys live in load.py's GGUF_ARCHITECTURES; these
# are the values llama.cpp does not store and assumes for gemma3 itself.


def gguf_config_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the gemma3 settings a GGUF file leaves out (llama.cpp's own choices).

    Local RoPE base 10000, 5 local : 1 global layers, and query_pre_attn_scalar =
    hidden / heads on the 62-layer (27B) model, head_dim otherwise.
    """
    config = dict(config)
    if config["num_hidden_layers"] == 62:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = config["head_dim"]
    config.setdefault("rope_local_base_freq", 10_000.0)
    config.setdefault("sliding_window_pattern", 6)
    return config
