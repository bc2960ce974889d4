"""The CPU fast paths `ts.load` applies on MLX's CPU backend (`loading/cpu.py`): RoPE from
per-step tables and compiled RMSNorm compute what they replace, a RoPE module the tables do
not reproduce is left alone, and a model's logits and greedy tokens do not move."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

import families
import turbospark_mlx as ts
from turbospark_mlx.loading.cpu import CompiledRMSNorm, TabledRoPE, cpu_fast_paths
from test_loading import CONFIG, random_model, write_hf_dir

ROPES = {
    "default": lambda: nn.RoPE(64, base=10000),
    "traditional": lambda: nn.RoPE(64, traditional=True, base=10000),
    "partial": lambda: nn.RoPE(32, base=10000),  # on 64-wide heads: a 32-feature tail untouched
    "llama3": lambda: initialize_rope(
        64, 500000.0, False,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        131072,
    ),  # fmt: skip
    "yarn": lambda: initialize_rope(
        64, 150000.0, False,
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "beta_slow": 1.0},
        131072,
    ),  # fmt: skip
}


@pytest.mark.parametrize("form", sorted(ROPES))
def test_tabled_rope_matches_the_module(form):
    rope = ROPES[form]()
    tabled = TabledRoPE.wrap(rope, {})
    assert tabled is not None
    for offset, rows in ((0, 1), (3, 4), (999, 1), (70000, 2)):
        x = mx.random.normal((2, 3, rows, 64), key=mx.random.key(offset))
        want, got = rope(x, offset=offset), tabled(x, offset=offset)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.abs(got - want).max().item() <= 2e-5 * (1 + mx.abs(want).max().item()), (form, offset, rows)


class _SquaringRoPE(nn.Module):
    """Has a RoPE module's attributes, but is not a rotation (not linear in x)."""

    dims, traditional = 64, False

    def __call__(self, x, offset=0):
        return nn.RoPE(64)(x * x, offset=offset)


def test_a_module_the_tables_do_not_reproduce_is_left_as_it_is():
    assert TabledRoPE.wrap(_SquaringRoPE(), {}) is None
    holder = nn.Module()
    holder.rope = _SquaringRoPE()
    assert cpu_fast_paths(holder) == {"rope": 0, "rms_norm": 0}
    assert isinstance(holder.rope, _SquaringRoPE)


def test_layers_with_the_same_rotation_share_one_table():
    shared = {}
    a, b = (TabledRoPE.wrap(nn.RoPE(64, base=10000), shared) for _ in range(2))
    c = TabledRoPE.wrap(nn.RoPE(64, base=500000), shared)
    assert a._tables is b._tables and a._tables is not c._tables and len(shared) == 2
    # A call at a new position refreshes the shared table; each module still gets its own rotation.
    x = mx.random.normal((1, 2, 1, 64))
    assert mx.allclose(a(x, offset=5), nn.RoPE(64, base=10000)(x, offset=5), atol=1e-5).item()
    assert mx.allclose(c(x, offset=5), nn.RoPE(64, base=500000)(x, offset=5), atol=1e-5).item()
    assert mx.allclose(b(x, offset=6), nn.RoPE(64, base=10000)(x, offset=6), atol=1e-5).item()


def test_compiled_rms_norm_matches_and_keeps_the_parameter_name():
    norm = nn.RMSNorm(48, eps=1e-6)
    norm.weight = mx.random.normal((48,))
    fast = CompiledRMSNorm(norm)
    x = mx.random.normal((2, 5, 48)) * 3
    assert mx.abs(fast(x) - norm(x)).max().item() <= 1e-5 * mx.abs(norm(x)).max().item()
    assert [k for k, _ in tree_flatten(fast.parameters())] == ["weight"]


def test_fast_paths_keep_a_models_logits_and_tokens():
    model, fast = random_model(), random_model()
    counts = cpu_fast_paths(fast)
    n = CONFIG["num_hidden_layers"]
    assert counts == {"rope": n, "rms_norm": 2 * n + 1}
    assert [k for k, _ in tree_flatten(fast.parameters())] == [k for k, _ in tree_flatten(model.parameters())]
    ids = mx.array([[5, 9, 14, 3, 22, 40, 7]])
    for kv in ("fp16", "k8v4"):
        caches = [ts.make_cache(m, kv) for m in (model, fast)]
        logits = [m(ids, cache=c) for m, c in zip((model, fast), caches)]
        for _ in range(6):  # decode steps at new positions: the tables move with the offset
            assert mx.abs(logits[0] - logits[1]).max().item() <= 1e-5 * (1 + mx.abs(logits[0]).max().item())
            y = mx.argmax(logits[0][:, -1], -1)[:, None]
            assert mx.array_equal(y, mx.argmax(logits[1][:, -1], -1)[:, None]).item()
            logits = [m(y, cache=c) for m, c in zip((model, fast), caches)]


def test_load_on_the_cpu_applies_them(tmp_path):
    loaded, _ = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    assert mx.default_device() == mx.cpu
    kinds = {type(m) for _, m in loaded.named_modules()}
    assert TabledRoPE in kinds and CompiledRMSNorm in kinds and nn.RMSNorm not in kinds


@pytest.mark.parametrize("family", sorted(families.CONFIGS))
def test_every_familys_logits_and_tokens_stay(family):
    # Sliding windows, partial and proportional rotations, gemma's norms (left as they are), sinks.
    _, model = families.pair(family)
    _, fast = families.pair(family)
    counts = cpu_fast_paths(fast)
    assert counts["rope"] > 0, counts
    prompt = mx.array([[5, 9, 14, 3, 22, 40, 7, 11, 2, 60, 33, 18]])
    for kv in ("fp16", "k8v4"):
        caches = [ts.make_cache(m, kv) for m in (model, fast)]
        logits = [m(prompt, cache=c) for m, c in zip((model, fast), caches)]
        for _ in range(8):
            scale = 1 + mx.abs(logits[0]).max().item()
            assert mx.abs(logits[0] - logits[1]).max().item() <= 1e-4 * scale, (family, kv)
            y = mx.argmax(logits[0][:, -1], -1)[:, None]
            assert mx.array_equal(y, mx.argmax(logits[1][:, -1], -1)[:, None]).item()
            logits = [m(y, cache=c) for m, c in zip((model, fast), caches)]
