"""Gemma 4 multimodal checkpoints, text only: a thin wrapper around gemma4_text.

Vision / audio towers and embedders are dropped; the language model runs on
the TurboQuant cache exactly as `gemma4_text` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4 as _mlx_gemma4

from ..cache import KVCacheManager, LayerSpec
from . import gemma4_text
from .base import BaseModelArgs


@dataclass
class ModelArgs(BaseModelArgs):
    text_config: dict
    model_type: str = "gemma4"
    vocab_size: int = 262144

    def __post_init__(self):
        # Defaults mlx-lm assumes when the multimodal config leaves them out.
        self.text_config = {"num_attention_heads": 8, "num_key_value_heads": 1, **self.text_config}
        self.text_config["vocab_size"] = self.vocab_size


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(args.text_config))

    def __call__(self, inputs: mx.array, cache: KVCacheManager | None = None) -> mx.array:
        return self.language_model(inputs, cache=cache)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # mlx-lm's: strip "model.", drop the non-text towers, then gemma4_text's sanitize.
        return _mlx_gemma4.Model.sanitize(self, weights)

    @property
    def max_context(self) -> int | None:
        return self.language_model.max_context

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        self.language_model.shard(group)

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        self.language_model.pipeline(group, split)

    @property
    def layers(self):
        return self.language_model.layers

    def kv_layer_specs(self) -> list[LayerSpec]:
        return self.language_model.kv_layer_specs()
