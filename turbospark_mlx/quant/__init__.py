"""TurboQuant: presets, codebooks, rotations, packing, per-layer tables and the reference quantizer."""

from .codebook import Codebook, lloyd_max_codebook
from .config import PRESETS, TurboQuantConfig, get_preset
from .packing import pack_indices, packed_words, unpack_indices
from .reference import dequantize_ref, quantize_ref
from .rotation import Rotation
from .tables import LayerQuant, SideQuant, side_quant

__all__ = [
    "Codebook",
    "LayerQuant",
    "PRESETS",
    "Rotation",
    "SideQuant",
    "TurboQuantConfig",
    "dequantize_ref",
    "get_preset",
    "lloyd_max_codebook",
    "pack_indices",
    "packed_words",
    "quantize_ref",
    "side_quant",
    "unpack_indices",
]
