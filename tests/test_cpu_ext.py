"""The packed-weight products on the CPU (`turbospark_mlx/cpu_ext`): the kernel against its
reference (`mx.dequantize` then a matmul) over bits, group sizes, row counts on both paths
(packed rows, dequantized tiles through BLAS) and layouts; the layers `ts.load` puts in a
quantized model's place; the build and the fallback when it cannot be used."""

import copy
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import families
import turbospark_mlx as ts
from turbospark_mlx import cpu_ext
from turbospark_mlx.loading.cpu import (
    PackedEmbedding,
    PackedLinear,
    packed_weight_paths,
    packed_weights_supported,
)
from test_loading import CONFIG, random_model, write_hf_dir


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


FLAGS = _cpu_flags()
# The instruction sets whose kernels this CPU runs, widest first.
NEEDS = {"avx512": (" avx512f", " avx512bw", " avx512vl"), "avx2": (" avx2", " fma")}
ISAS = [name for name, flags in NEEDS.items() if all(f in FLAGS for f in flags)]
# Where the kernels can run, they must be in use: a build that fails here is a failure, not a skip.
HOST = sys.platform.startswith("linux") and platform.machine() == "x86_64" and bool(ISAS)
COMPILER = shutil.which("c++") or shutil.which("g++")
pytestmark = [
    pytest.mark.skipif(not HOST, reason="the CPU kernels need Linux on x86-64 with AVX2 or AVX-512"),
    pytest.mark.skipif(not COMPILER, reason="building the CPU kernels needs a C++ compiler (c++ or g++)"),
]


@pytest.fixture(params=ISAS)
def isa(request):
    """Each instruction set's kernels in turn, then the widest again."""
    cpu_ext.set_isa(request.param)
    yield request.param
    cpu_ext.set_isa("auto")


def test_the_kernels_are_built_and_in_use_here():
    if os.environ.get("TURBOSPARK_CPU_KERNELS", "").lower() == "off":
        pytest.skip("TURBOSPARK_CPU_KERNELS=off")
    assert cpu_ext.available(), cpu_ext.status()
    assert cpu_ext.status().startswith(f"in use ({ISAS[0]}, "), cpu_ext.status()
    with pytest.raises(ValueError, match="not one this CPU runs"):
        cpu_ext.set_isa("sse2")


def _reference(x, w, s, b, group_size, bits):
    dense = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ dense.T).astype(x.dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_kernel_matches_the_reference(bits, group_size, isa):
    key = mx.random.key(bits * 1000 + group_size)
    k1, k2 = mx.random.split(key)
    # 300 outputs: split over threads, with a remainder. Rows: 1 to 4 in one pass over the packed
    # weights, 5 and 8 in two, 9 and 37 through the BLAS tiles.
    for n, k in ((300, 256), (17, 384), (1, 128)):
        w, s, b = mx.quantize(mx.random.normal((n, k), key=k1), group_size=group_size, bits=bits)
        for rows in (1, 3, 4, 5, 8, 9, 37):
            x = mx.random.normal((rows, k), key=k2)
            got = cpu_ext.quantized_matmul(x, w, s, b, group_size, bits)
            want = _reference(x, w, s, b, group_size, bits)
            assert got.shape == want.shape == (rows, n) and got.dtype == mx.float32
            scale = mx.abs(want).max().item()
            assert mx.abs(got - want).max().item() <= 2e-6 * scale * (k / 128), (n, k, rows)


def test_leading_dimensions_strides_and_dtypes(isa):
    w, s, b = mx.quantize(mx.random.normal((96, 128), key=mx.random.key(1)), group_size=32, bits=4)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(2))
    want = _reference(x, w, s, b, 32, 4)
    assert mx.allclose(cpu_ext.quantized_matmul(x, w, s, b, 32, 4), want, atol=1e-4).item()
    # a transposed (non-contiguous) input, one row and several
    for xt in (mx.random.normal((128, 1), key=mx.random.key(3)).T, mx.random.normal((128, 6)).T):
        got = cpu_ext.quantized_matmul(xt, w, s, b, 32, 4)
        assert mx.allclose(got, _reference(xt, w, s, b, 32, 4), atol=1e-4).item()
    half = x.astype(mx.float16)
    got = cpu_ext.quantized_matmul(half, w, s, b, 32, 4)
    assert got.dtype == mx.float16
    assert mx.allclose(got, _reference(half, w, s, b, 32, 4), atol=2e-2, rtol=1e-2).item()


def test_a_rows_result_does_not_depend_on_its_batch(isa):
    # Up to 8 rows (the packed path): a sequence batched with others gets the bits it gets alone,
    # so the server's batched requests equal `generate` run alone.
    for bits in (4, 8):
        w, s, b = mx.quantize(mx.random.normal((300, 320), key=mx.random.key(bits)), group_size=64, bits=bits)
        x = mx.random.normal((8, 320), key=mx.random.key(7))
        alone = [cpu_ext.quantized_matmul(x[i : i + 1], w, s, b, 64, bits) for i in range(8)]
        for rows in (2, 3, 5, 8):
            batch = cpu_ext.quantized_matmul(x[:rows], w, s, b, 64, bits)
            for i in range(rows):
                assert mx.array_equal(batch[i : i + 1], alone[i]).item(), (bits, rows, i)


def test_twice_gives_identical_outputs(isa):
    w, s, b = mx.quantize(mx.random.normal((1000, 512), key=mx.random.key(4)), group_size=64, bits=4)
    for rows in (1, 64):
        x = mx.random.normal((rows, 512), key=mx.random.key(rows))
        first, second = (cpu_ext.quantized_matmul(x, w, s, b, 64, 4) for _ in range(2))
        assert mx.array_equal(first, second).item()


def test_runs_on_a_threads_own_stream():
    # The server's engine thread runs the model on a thread-local stream, as mlx-lm's does.
    w, s, b = mx.quantize(mx.random.normal((64, 128), key=mx.random.key(5)), group_size=32, bits=4)
    x = mx.random.normal((3, 128), key=mx.random.key(6))
    mx.eval(w, s, b, x)
    y = _on_a_thread_local_stream(lambda: cpu_ext.quantized_matmul(x, w, s, b, 32, 4))
    assert mx.allclose(y, _reference(x, w, s, b, 32, 4), atol=1e-4).item()


def _on_a_thread_local_stream(compute):
    """compute(), evaluated on another thread under its own thread-local stream, as the
    server's engine thread runs the model; its exception raised here."""
    out = {}

    def run():
        try:
            with mx.stream(mx.new_thread_local_stream(mx.cpu)):
                out["value"] = compute()
                mx.eval(out["value"])
        except Exception as e:  # raised below, on the test's thread
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_bad_arguments_are_named():
    w, s, b = mx.quantize(mx.random.normal((64, 128)), group_size=32, bits=4)
    x = mx.random.normal((1, 128))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        cpu_ext.quantized_matmul(x, w, s, b, 32, 3)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        cpu_ext.quantized_matmul(x, w, s, b, 16, 4)
    with pytest.raises(ValueError, match=r"scales and biases must be float32 of shape \(64, 4\)"):
        cpu_ext.quantized_matmul(x, w, s[:, :2], b, 32, 4)
    with pytest.raises(ValueError, match="last dimension 128"):
        cpu_ext.quantized_matmul(mx.random.normal((1, 96)), w, s, b, 32, 4)


def _quantized(model, bits=4, group_size=32):
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def _quantized_dir(tmp_path):
    """An HF directory of a tiny llama quantized as mlx-community publishes it (4 bits, groups of 32)."""
    config = dict(CONFIG, quantization={"group_size": 32, "bits": 4})
    return write_hf_dir(tmp_path / "q", _quantized(random_model()), config=config)


def test_packed_layers_keep_a_quantized_models_logits_and_tokens():
    config = dict(CONFIG, tie_word_embeddings=True)
    reference = _quantized(random_model(config))
    packed = copy.deepcopy(reference)
    n = config["num_hidden_layers"]
    assert packed_weight_paths(packed) == 7 * n + 1  # q, k, v, o, gate, up, down; the embedding
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert isinstance(packed.model.layers[0].mlp.down_proj, PackedLinear)
    assert sorted(k for k, _ in nn.utils.tree_flatten(packed.parameters())) == sorted(
        k for k, _ in nn.utils.tree_flatten(reference.parameters())
    )
    ids = mx.array([[5, 9, 14, 3, 22, 40, 7]])
    for kv in ("fp16", "k8v4"):
        caches = [ts.make_cache(m, kv) for m in (reference, packed)]
        logits = [m(ids, cache=c) for m, c in zip((reference, packed), caches)]
        for _ in range(6):
            scale = 1 + mx.abs(logits[0]).max().item()
            assert mx.abs(logits[0] - logits[1]).max().item() <= 1e-4 * scale, kv
            y = mx.argmax(logits[0][:, -1], -1)[:, None]
            assert mx.array_equal(y, mx.argmax(logits[1][:, -1], -1)[:, None]).item()
            logits = [m(y, cache=c) for m, c in zip((reference, packed), caches)]


def test_load_keeps_quantized_weights_packed_on_the_cpu(tmp_path):
    path = _quantized_dir(tmp_path)
    packed, _ = ts.load(path)
    dense, _ = ts.load(path, dequantize=True)
    assert isinstance(packed.model.layers[1].self_attn.q_proj, PackedLinear)
    assert type(dense.model.layers[1].self_attn.q_proj) is nn.Linear
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    a, b = packed(ids), dense(ids)
    assert mx.abs(a - b).max().item() <= 1e-4 * (1 + mx.abs(b).max().item())


def test_a_loaded_model_runs_on_another_threads_stream(tmp_path):
    # As the server's engine thread runs it: streams made on the loading thread are not there.
    model, _ = ts.load(_quantized_dir(tmp_path))
    ids = mx.array([[3, 1, 4, 1, 5]])
    logits = _on_a_thread_local_stream(lambda: model(ids))
    assert mx.allclose(logits, model(ids), atol=1e-4).item()


def test_only_models_whose_packed_layers_all_take_the_kernels_stay_packed():
    assert packed_weights_supported(_quantized(random_model()))
    assert not packed_weights_supported(random_model())  # nothing packed
    assert not packed_weights_supported(_quantized(random_model(), bits=3))
    # gpt-oss's experts become mlx-lm's QuantizedSwitchLinear, which the kernels do not take
    _, moe = families.pair("gpt_oss")
    nn.quantize(moe, group_size=32, bits=4)
    assert any(type(m).__name__ == "QuantizedSwitchLinear" for _, m in moe.named_modules())
    assert not packed_weights_supported(moe)


def test_a_model_split_by_heads_is_unpacked(tmp_path):
    # `shard` turns layers into mlx-lm's sharded kinds, which the kernels do not take: packed,
    # they would run MLX's slow quantized matmul, so the loader unpacks them first.
    path = _quantized_dir(tmp_path)
    sharded, _ = ts.load(path, group=mx.distributed.init())  # a group of one, in this process
    kinds = {type(m).__name__ for name, m in sharded.named_modules() if name.endswith("_proj")}
    assert kinds and not any("Quantized" in k for k in kinds), kinds
    ids = mx.array([[3, 1, 4, 1, 5]])
    want = ts.load(path)[0](ids)
    assert mx.abs(sharded(ids) - want).max().item() <= 1e-4 * (1 + mx.abs(want).max().item())


def test_turned_off_it_unpacks_as_before(tmp_path):
    path = _quantized_dir(tmp_path)
    code = (
        "import turbospark_mlx as ts, mlx.nn as nn, sys\n"
        f"m, _ = ts.load({str(path)!r})\n"
        "print(ts.cpu_ext.status()); print(type(m.model.layers[0].mlp.up_proj).__name__)\n"
    )
    env = dict(os.environ, TURBOSPARK_CPU_KERNELS="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["off (TURBOSPARK_CPU_KERNELS)", "Linear"], out.stdout + out.stderr


def test_a_failed_build_warns_names_the_cause_and_unpacks(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda *a, **k: None)  # no cmake anywhere
    with pytest.warns(RuntimeWarning, match="did not build .cmake was not found"):
        assert not cpu_ext.available()
    assert "cmake was not found" in cpu_ext.status()
    with pytest.raises(RuntimeError, match="cmake was not found"):
        w, s, b = mx.quantize(mx.zeros((8, 32)), group_size=32, bits=4)
        cpu_ext.quantized_matmul(mx.zeros((1, 32)), w, s, b, 32, 4)
    assert not any(tmp_path.rglob("*.so"))


def test_the_build_is_cached_per_source_and_version(monkeypatch, tmp_path):
    if os.environ.get("TURBOSPARK_CPU_KERNELS", "").lower() == "off":
        pytest.skip("TURBOSPARK_CPU_KERNELS=off")
    assert cpu_ext.available()
    built = Path(cpu_ext._extension().__file__)
    assert built.parent.name == cpu_ext._build_key() and built.parent.parent == cpu_ext._cache_root()
    # a second process finds the module and builds nothing
    code = "import turbospark_mlx as ts; print(ts.cpu_ext.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"in use ({ISAS[0]}, {built})" and "building" not in out.stderr
