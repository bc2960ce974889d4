import os

# The suite checks exact equalities (a chunked prefill stores the rows one-token steps store, bit
# for bit; a batched sequence's logits equal its single run's) that hold on MLX's own BLAS, which
# rounds a row's dot products the same whatever the row count;
# MKL's GEMM and GEMV kernels differ in the last bits. tests/test_cpu_blas.py runs MKL in its
# own processes.
os.environ.setdefault("TURBOSPARK_CPU_BLAS", "reference")

from turbospark_mlx import KVCacheManager, TurboQuantConfig, get_preset  # noqa: E402  isort: skip

import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


def plain(name: str) -> TurboQuantConfig:
    """A preset without its FP16 window, sink rows and key centring: plain TurboQuant layers,
    whose storage is codes only (what the tests of the codes path need)."""
    return get_preset(name).plain()


def random_kv(B, H, L, D, dtype=mx.float16, scale=1.0):
    k = (scale * mx.random.normal((B, H, L, D))).astype(dtype)
    v = (scale * mx.random.normal((B, H, L, D))).astype(dtype)
    return k, v


def committed_state(cache: KVCacheManager) -> dict:
    """Everything visible in a cache: per layer the offset and the committed rows."""
    out = {"offset": cache.offset}
    for i in range(cache.n_layers):
        if cache.specs[i].shared_from is not None:
            continue
        off = cache.layer_offset(i)
        out[i] = {name: a[:, :, : min(off, a.shape[2])] for name, a in cache.layer_arrays(i).items()}
        out[i]["offset"] = off
    return out


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if key == "offset":
            assert a[key] == b[key]
            continue
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            if name == "offset":
                assert a[key][name] == b[key][name]
            else:
                assert mx.array_equal(a[key][name], b[key][name]).item(), (key, name)
