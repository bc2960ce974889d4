import mlx.core as mx
import numpy as np
import pytest

from turbospark_mlx.quant import pack_indices, packed_words, side_quant, unpack_indices
from turbospark_mlx.quant.rotation import Rotation, seeded_rng


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 200, 512])
def test_pack_roundtrip(bits, d):
    idx = mx.random.randint(0, 1 << bits, (3, 5, d)).astype(mx.uint32)
    words = pack_indices(idx, bits)
    assert words.dtype == mx.uint32 and words.shape == (3, 5, packed_words(d, bits))
    assert mx.array_equal(unpack_indices(words, bits, d), idx).item()


def test_packed_words_use_exact_bits_at_common_dims():
    for d in (64, 96, 128, 256, 512):
        for bits in (2, 3, 4, 8):
            assert packed_words(d, bits) * 32 == d * bits


def test_3bit_layout_is_two_aligned_planes():
    d = 32
    idx = mx.array([[5] * d], dtype=mx.uint32)  # 0b101: low bits 01, high bit 1
    words = pack_indices(idx, 3)
    low = int(sum(1 << (2 * s) for s in range(16)))
    assert words.tolist() == [[low, low, 0xFFFFFFFF]]


def test_unpack_rejects_wrong_word_count():
    with pytest.raises(ValueError, match="words"):
        unpack_indices(mx.zeros((2, 3), dtype=mx.uint32), 4, 128)
    with pytest.raises(ValueError, match="bits"):
        packed_words(128, 5)


@pytest.mark.parametrize("d,kind", [(64, "hadamard"), (128, "hadamard"), (512, "hadamard"), (96, "dense"), (80, "dense")])
def test_rotation_orthogonal_and_invertible(d, kind):
    rot = side_quant(4, d, "auto", 7, 2, "k").rotation
    assert rot.kind == kind
    P = rot.dense
    assert mx.allclose(P @ P.T, mx.eye(d), atol=1e-5).item()
    x = mx.random.normal((4, d))
    assert mx.allclose(rot.invert(rot.apply(x)), x, atol=1e-5).item()
    assert mx.allclose(rot.apply(x), x @ P.T, atol=1e-5).item()


def test_rotations_are_seeded_per_layer_and_side():
    a = side_quant(4, 128, "auto", 0, 0, "k").rotation.signs
    b = Rotation.make("auto", 128, seeded_rng(0, 0, 0)).signs
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, side_quant(4, 128, "auto", 0, 1, "k").rotation.signs).item()
    assert not mx.array_equal(a, side_quant(4, 128, "auto", 0, 0, "v").rotation.signs).item()
    assert not mx.array_equal(a, side_quant(4, 128, "auto", 1, 0, "k").rotation.signs).item()


def test_hadamard_needs_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        Rotation.make("hadamard", 96, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown rotation"):
        Rotation.make("givens", 96, np.random.default_rng(0))
