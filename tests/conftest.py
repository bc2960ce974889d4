import os

# The suite checks exact equalities (a chunked prefill stores the rows one-token steps store, bit
# for bit; a batched sequence's logits equal its single run's) that hold on MLX's own BLAS, which
# rounds a row's dot products the same whatever the row count;
# MKL's GEMM and GEMV kernels differ in the last bits. tests/test_cpu_blas.py runs MKL in its
# own processes.
os.environ.setdefault("TURBOSPARK_CPU_BLAS", "reference")

from turbospark_mlx import KVCacheManager, TurboQuantConfig, get_preset  # noqa: E402  isort: skip

import mlx.core as mx
import numpy as np
import pytest

from turbospark_mlx.quant.reference import dequantize_ref, fp16_attention_ref


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


def plain(name: str) -> TurboQuantConfig:
    """A preset without its FP16 window, sink rows and key centring: plain TurboQuant layers,
    whose storage is codes only (what the tests of the codes path need)."""
    return get_preset(name).plain()


def rel_l2(got: mx.array, want: mx.array) -> float:
    """||got - want|| / ||want|| in float64; `got` must be finite."""
    a = np.asarray(got.astype(mx.float32), dtype=np.float64)
    b = np.asarray(want.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


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


def prefill_reference(cache: KVCacheManager, layer: int, q: mx.array, pos: int, sinks=None) -> mx.array:
    """What the prefill path (`attention._prefill_attention`) computes for the M query rows at
    [pos, pos + M), in float32 on the CPU: dense attention, causal, over the history decoded by
    `dequantize_ref` and, on a protected layer, the sink rows and the ring's rows from the
    committed end before the chunk on."""
    config, a, quant = cache.config, cache.layer_arrays(layer), cache.layer_quant(layer)
    end = pos + q.shape[2]
    with mx.stream(mx.cpu):
        rows = {}
        for s in ("k", "v"):
            if not config.is_protected:
                codes, norms = a[f"{s}_codes"][:, :, :end], a[f"{s}_norms"][:, :, :end]
                rows[s] = dequantize_ref(codes, norms, quant.side(s))
                continue
            mean = a.get("k_mean") if s == "k" and config.center_keys else None
            S, lo = config.sink_rows, cache.quantized_end(layer, pos)
            parts = [a[f"{s}_sinks"][:, :, : min(S, end)].astype(mx.float32)]
            if lo > S:
                codes, norms = a[f"{s}_codes"][:, :, : lo - S], a[f"{s}_norms"][:, :, : lo - S]
                x = dequantize_ref(codes, norms, quant.side(s))
                parts.append(x if mean is None else x + mean[:, :, None])
            at = mx.arange(lo, end) % cache.recent_capacity(layer)
            parts.append(mx.take(a[f"{s}_recent"], at, axis=2).astype(mx.float32))
            rows[s] = mx.concatenate(parts, axis=2)
        qp, kp = mx.arange(pos, end)[:, None], mx.arange(end)[None]
        return fp16_attention_ref(q.astype(mx.float32), rows["k"], rows["v"], scale=q.shape[-1] ** -0.5,
                                  mask=(kp <= qp)[None, None], sinks=sinks)
