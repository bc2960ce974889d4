"""Gemma 3 multimodal checkpoints, text only: a thin wrapper around gemma3_text.

The vision tower and projector weights are dropped; the language model runs
on the TurboQuant cache exactly as `gemma3_text` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3 as _mlx_gemma3

from ..cache import KVCacheManager, LayerSpec
from . import gemma3_text
from .base import BaseModelArgs


@dataclass
class ModelArgs(BaseModelArgs):
    text_config: dict
    model_type: str = "gemma3"
    vocab_size: int = 262208

    def __post_init__(self):
        # The multimodal configs leave these to HF's Gemma3TextConfig defaults.
        self.text_config = {"num_attention_heads": 8, "num_key_value_heads": 4, **self.text_config}
        self.text_config["vocab_size"] = self.vocab_size


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(args.text_config))

    def __call__(
        self, inputs: mx.array, cache: KVCacheManager | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        return self.language_model(inputs, cache=cache, input_embeddings=input_embeddings)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # mlx-lm's: drop vision_tower / multi_modal_projector, sanitize the language model.
        return _mlx_gemma3.Model.sanitize(self, weights)

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor parallel over `group`: the language model's `shard`."""
        self.language_model.shard(group)

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        """Pipeline parallel over `group`: the language model's `pipeline`."""
        self.language_model.pipeline(group, split)

    @property
    def max_context(self) -> int | None:
        return self.language_model.max_context

    @property
    def layers(self):
        return self.language_model.layers

    def kv_layer_specs(self) -> list[LayerSpec]:
        return self.language_model.kv_layer_specs()
