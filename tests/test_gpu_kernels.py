"""GPU kernels against their references (run on a Metal or CUDA machine: pytest -m gpu).

Tolerances: the dialect kernels compute in float32 (scores, online softmax, weighted V),
in another summation order than the reference, so outputs agree to ~1e-6
relative; we assert 2e-5 on float32 queries. The tensor-core kernel (CUDA) rounds
q'/||q'||, the centroids and the softmax weights to fp16 (accumulating in fp32): we
assert 5e-3 relative L2 and report the measured error. Quantize codes may differ from
`quantize_ref` only at float32 ties with a cell boundary: at most 1 in 10^4
coordinates, by one cell.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import prefill_reference, rel_l2
from turbospark_mlx import KVCacheManager, LayerSpec, attention_any, commit_kv, get_preset, kv_write_target, store_kv
from turbospark_mlx import attention as attention_module
from turbospark_mlx.attention import PREFILL_MIN_ROWS, attention_mask
from turbospark_mlx.gpu import build, decode_mma
from turbospark_mlx.gpu.backend import KernelUnsupported, auto_backend, use_backend
from turbospark_mlx.gpu.decode import tq_decode_attention
from turbospark_mlx.gpu.dequantize import tq_dequantize
from turbospark_mlx.gpu.quantize import tq_quantize
from turbospark_mlx.quant.packing import unpack_indices
from turbospark_mlx.quant.reference import quantize_ref, tq_attention_ref
from turbospark_mlx.quant.tables import LayerQuant, side_quant

pytestmark = pytest.mark.gpu

BACKEND = auto_backend()
if BACKEND == "reference":
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skip(reason="needs a Metal or CUDA GPU (MLX default device is not a GPU)"),
    ]


def _quant(kb: int, vb: int, d: int, layer: int = 0) -> LayerQuant:
    return LayerQuant(
        layer, side_quant(kb, d, "auto", 7, layer, "k"), side_quant(vb, d, "auto", 7, layer, "v")
    )


@pytest.mark.parametrize("d", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_quantize_kernel_matches_ref(d, bits):
    side = side_quant(bits, d, "auto", 3, 1, "k")
    for dtype in (mx.float16, mx.bfloat16, mx.float32) if d == 128 else (mx.float16,):
        x = (3 * mx.random.normal((2, 3, 37, d))).astype(dtype)
        x[0, 0, 0] = 0  # a zero row
        codes, norms = tq_quantize(x, side, backend=BACKEND)
        with mx.stream(mx.cpu):  # float32 matmuls on MLX CUDA may run as TF32: the oracle runs on the CPU
            ref_codes, ref_norms = quantize_ref(x, side)
        assert codes.shape == ref_codes.shape and codes.dtype == mx.uint32
        assert mx.allclose(norms, ref_norms, rtol=1e-6, atol=0).item()
        idx = np.asarray(unpack_indices(codes, bits, d)).astype(np.int64)
        ref = np.asarray(unpack_indices(ref_codes, bits, d)).astype(np.int64)
        diff = np.abs(idx - ref)
        assert diff.max() <= 1 and (diff > 0).mean() <= 1e-4, (dtype, (diff > 0).sum())
        again, _ = tq_quantize(x, side, backend=BACKEND)
        assert mx.array_equal(codes, again).item()


CASES = [
    # B, Hq, Hkv, M, D, kb, vb, L, kv_start, sinks
    (1, 4, 1, 1, 128, 4, 4, 1000, 0, False),
    (2, 8, 2, 1, 64, 3, 2, 777, 0, True),
    (1, 32, 8, 1, 128, 4, 3, 5000, 0, False),
    (3, 6, 3, 2, 96, 8, 4, 300, [0, 17, 150], True),
    (1, 4, 1, 4, 256, 2, 8, 2049, 5, False),
    (2, 16, 2, 1, 512, 4, 4, 1500, [3, 0], True),
    (1, 12, 4, 7, 128, 3, 3, 64, 0, False),
    (1, 8, 1, 3, 512, 4, 2, 400, 0, False),  # 24 query rows at D=512: split into calls
    (1, 40, 8, 1, 128, 8, 8, 70000, 1000, True),
    (2, 2, 2, 1, 64, 1, 4, 33, 0, False),
]


def _decode_case(case, variant):
    """(kernel output, fp32 CPU oracle, a second kernel run) for one case."""
    B, Hq, Hkv, M, D, kb, vb, L, kv_start, use_sinks = case
    quant = _quant(kb, vb, D)
    cap = L + 37  # storage past the visible keys holds garbage the kernel must not read
    k = mx.random.normal((B, Hkv, cap, D))
    v = mx.random.normal((B, Hkv, cap, D))
    kc, kn = quantize_ref(k, quant.k)
    vc, vn = quantize_ref(v, quant.v)
    kn[:, :, L:] = float("nan")
    vn[:, :, L:] = float("nan")
    q = 2 * mx.random.normal((B, Hq, M, D))
    sinks = mx.random.normal((Hq,)) if use_sinks else None
    start = mx.array(kv_start, dtype=mx.int32) if isinstance(kv_start, list) else kv_start
    position = L - M
    scale = 0.7 / D**0.5

    def run():
        return tq_decode_attention(
            q,
            kc,
            kn,
            vc,
            vn,
            quant,
            scale=scale,
            position=position,
            kv_start=start,
            sinks=sinks,
            backend=BACKEND,
            variant=variant,
        )

    out = run()
    with mx.stream(mx.cpu):  # exact float32 oracle (MLX CUDA matmuls may use TF32)
        mask = attention_mask(mx.arange(L), mx.arange(position, L), start)
        ref = tq_attention_ref(
            q,
            kc[:, :, :L],
            kn[:, :, :L],
            vc[:, :, :L],
            vn[:, :, :L],
            quant,
            scale=scale,
            mask=mask,
            sinks=sinks,
        )
        mx.eval(ref)
    return out, ref, run()


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_decode_kernel_matches_ref(case):
    out, ref, again = _decode_case(case, "dialect")
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 2e-5
    assert mx.array_equal(out, again).item()


MMA_CASES = [
    # B, Hq, Hkv, M, D, kb, vb, L, kv_start, sinks
    (1, 32, 8, 1, 128, 4, 4, 5000, 0, False),  # llama 8B shape, tq4
    (1, 32, 8, 1, 128, 3, 3, 70000, 0, True),  # tq3, many splits
    (2, 8, 2, 1, 64, 3, 2, 777, 0, True),
    (1, 9, 3, 1, 64, 8, 4, 1000, 0, False),  # SmolLM2 shape, k8v4 (separate K and V tables)
    (3, 6, 3, 2, 128, 8, 4, 300, [0, 17, 150], True),  # per-sequence starts, M = 2
    (1, 4, 1, 4, 256, 2, 8, 2049, 5, False),
    (2, 16, 2, 1, 256, 4, 3, 1500, [3, 0], True),  # G = 8
    (1, 12, 4, 7, 128, 3, 3, 64, 0, False),  # 21 query rows: two calls
    (1, 64, 8, 1, 64, 4, 4, 33, 0, True),  # gpt-oss shape
    (1, 16, 1, 1, 128, 4, 4, 3000, 0, False),  # G = 16: a full score tile
    (1, 8, 8, 1, 128, 4, 8, 17, 0, False),  # G = 1, one partial tile
    (1, 8, 2, 1, 128, 8, 8, 40000, 39990, True),  # all but 10 keys before kv_start
    (1, 16, 2, 1, 64, 2, 2, 9000, 0, False),  # tq2, D 64: pair indices as bytes (PL)
    (1, 24, 8, 1, 64, 3, 3, 12345, 0, True),  # tq3, D 64, G 3 (PL)
    (2, 32, 8, 1, 128, 3, 3, 4100, [0, 100], False),  # tq3 (PL), per-sequence starts
    (1, 32, 8, 1, 128, 4, 3, 6000, 0, True),  # k4v3: K and V tables side by side (PL), 16 warps
    (1, 32, 8, 1, 128, 8, 4, 20000, 0, False),  # k8v4 (the default preset), llama shape (PL), 8 warps
    # Chunks taken as warps go (long contexts), with the rest walked slot by slot: from kv_start
    # to the first whole chunk, and the last keys, which some of the M rows do not see.
    (1, 32, 8, 3, 128, 4, 4, 30000, 4321, True),
    (2, 32, 8, 1, 128, 4, 4, 40000, [1000, 33], False),  # per-sequence starts, 8 splits
]


@pytest.mark.parametrize("case", MMA_CASES, ids=[f"mma{i}" for i in range(len(MMA_CASES))])
def test_mma_decode_kernel_matches_ref(case):
    if BACKEND != "cuda":
        pytest.skip("the tensor-core decode kernel runs on CUDA only")
    out, ref, again = _decode_case(case, "mma")
    assert out.shape == ref.shape
    err = rel_l2(out, ref)
    print(f"rel L2 {err:.2e}")
    assert err < 5e-3
    assert mx.array_equal(out, again).item()


def test_mma_calls_without_dependency_in_one_eval(monkeypatch):
    """450 tq_decode_mma calls built without a data dependency, in one eval (MLX's CUDA graphs
    run such nodes concurrently, up to 100 per graph on sm_90): they share one scratch, kept
    in order by the chain (each takes the last one's output), so every output equals the same
    call evaluated alone, and the tickets are back at zero."""
    if BACKEND != "cuda":
        pytest.skip("the tensor-core decode kernel runs on CUDA only")
    monkeypatch.setattr(decode_mma, "_MMA_CHAIN", {})
    quant = _quant(4, 4, 128)
    kc, kn = quantize_ref(mx.random.normal((1, 8, 3000, 128)), quant.k)
    vc, vn = quantize_ref(mx.random.normal((1, 8, 3000, 128)), quant.v)
    qs = [mx.random.normal((1, 32, 1, 128)) for _ in range(450)]
    mx.eval(kc, kn, vc, vn, *qs)

    def call(q):
        return tq_decode_attention(
            q, kc, kn, vc, vn, quant, scale=0.09, position=2999, backend=BACKEND, variant="mma"
        )

    outs = [call(q) for q in qs]
    mx.eval(outs)
    scratch = decode_mma._MMA_CHAIN[mx.float32][0]
    for q, out in zip(qs, outs):
        alone = call(q)
        mx.eval(alone)
        assert mx.array_equal(out, alone).item()
    assert decode_mma._MMA_CHAIN[mx.float32][0] is scratch
    assert mx.max(scratch[: decode_mma.MMA_TICKET_WORDS]).item() == 0


def test_mma_variant_refuses_what_it_cannot_serve():
    if BACKEND != "cuda":
        pytest.skip("the tensor-core decode kernel runs on CUDA only")
    quant = _quant(4, 4, 96)
    kc, kn = quantize_ref(mx.random.normal((1, 1, 8, 96)), quant.k)
    with pytest.raises(KernelUnsupported, match="head_dim 96"):
        tq_decode_attention(
            mx.zeros((1, 4, 1, 96)),
            kc,
            kn,
            kc,
            kn,
            quant,
            scale=0.1,
            position=7,
            backend=BACKEND,
            variant="mma",
        )


def test_cache_paths_use_kernels_and_match_reference():
    specs = [LayerSpec(2, 128), LayerSpec(2, 96)]

    def run(backend):
        mx.random.seed(11)
        with use_backend(backend):
            cache = KVCacheManager(specs, kv=get_preset("k8v4").plain(), max_rows=16)  # the codes-only kernels
            assert all(cache.layer_quant(i) is not None for i in range(2))
            outs = []
            pos = 0
            for m in (9, 1, 1, 5):
                for layer, spec in enumerate(specs):
                    k = mx.random.normal((1, 2, m, spec.head_dim)).astype(mx.float16)
                    v = mx.random.normal((1, 2, m, spec.head_dim)).astype(mx.float16)
                    kv_write_target(cache, "k", layer, pos).write(k)
                    kv_write_target(cache, "v", layer, pos).write(v)
                    commit_kv(cache, layer, pos, m)
                    q = mx.random.normal((1, 6, m, spec.head_dim)).astype(mx.float32)
                    outs.append(attention_any(cache, layer, q, pos, sinks=mx.ones((6,))))
                pos += m
            mx.eval(outs)
            return outs, cache

    gpu_outs, gpu_cache = run(BACKEND)
    with mx.stream(mx.cpu):
        ref_outs, ref_cache = run("reference")
    for a, b in zip(gpu_outs, ref_outs):
        # codes may differ at boundary ties, and CUDA's tensor-core kernel rounds operands to fp16
        assert rel_l2(a, b) < 5e-3
    for layer in range(2):
        ga, ra = gpu_cache.layer_arrays(layer), ref_cache.layer_arrays(layer)
        n = gpu_cache.layer_offset(layer)
        same = mx.mean((ga["k_codes"][:, :, :n] == ra["k_codes"][:, :, :n]).astype(mx.float32)).item()
        assert same > 0.999


@pytest.mark.parametrize("commit", [1, 8])
@pytest.mark.parametrize("max_kv_size", [None, 48])
@pytest.mark.parametrize(
    "d,kv,dtype",
    [(128, "tq4", mx.float16), (64, "k8v4", mx.float16), (128, "tq3", mx.float16), (64, "k8v4", mx.float32)],
)
def test_protected_layers_match_reference(d, kv, dtype, max_kv_size, commit):
    """FP16 window + sink rows + key centring: the dialect kernels' partials over the codes
    merged with the FP16 rows' partial equal the reference over the same cache, for rows
    before, across and past the first quantized row, per-sequence starts and sink logits;
    two runs are identical. Bounded (max_kv_size): the codes ring wraps. Commit blocks of 8:
    the 3-row chunk's last row reads one more block of codes than its first two (the
    kernels' per-row floor). float32: a float32 model's FP16 rows (`model_dtype`)."""
    config = get_preset(kv).with_(name="p", window_rows=16, sink_rows=4, center_keys=True, commit_rows=commit)

    def run():
        mx.random.seed(5)
        cache = KVCacheManager(
            [LayerSpec(2, d)], config, batch_size=2, max_rows=40, max_kv_size=max_kv_size, dtype=dtype
        )
        starts = mx.array([0, 3])
        outs, refs, pos = [], [], 0
        for m in (12, 1, 1, 9, 1, 40, 1, 3, 33, 1):
            k = (mx.random.normal((2, 2, m, d)) + 4 * mx.random.normal((1, 2, 1, d))).astype(dtype)
            v = mx.random.normal((2, 2, m, d)).astype(dtype)
            with use_backend(BACKEND):
                store_kv(cache, 0, pos, k, v)
            first = max(pos, 3)
            q = mx.random.normal((2, 8, pos + m - first, d))
            with use_backend(BACKEND):
                outs.append(attention_any(cache, 0, q, first, sinks=mx.ones((8,)), kv_start=starts))
            with use_backend("reference"), mx.stream(mx.cpu):
                refs.append(attention_any(cache, 0, q, first, sinks=mx.ones((8,)), kv_start=starts))
            mx.eval(outs, refs)
            pos += m
        return outs, refs

    gpu, ref = run()
    again, _ = run()
    errs = [rel_l2(a, c) for a, c in zip(gpu, ref)]
    print(f"protected {kv} d {d}: max rel L2 {max(errs):.2e}")
    for a, b in zip(gpu, again):
        assert mx.array_equal(a, b).item()
    # The FP16 rows' partial is plain mx matmuls (MLX CUDA may run them as TF32); on CUDA the
    # one-row steps take the tensor-core kernel, which rounds its operands to fp16.
    assert max(errs) < (5e-3 if BACKEND == "cuda" else 2e-3), errs


@pytest.mark.skipif(BACKEND != "cuda", reason="the tensor-core decode kernel is CUDA-only")
@pytest.mark.parametrize("window", [128, 256])
@pytest.mark.parametrize("commit", [1, 64])
@pytest.mark.parametrize("kv,batch,d", [("tq4", 1, 128), ("k8v4", 2, 64), ("tq3", 1, 128)])
@pytest.mark.parametrize("chunk", [64, 128])
def test_protected_decode_step_is_one_launch(kv, batch, d, commit, window, chunk):
    """A decode step of a protected layer on CUDA (`store_and_attend`, ProtectedStep): the
    tensor-core kernel, which reads the codes and the FP16 rows, and `tq_commit` on a step that
    completes a commit block; nothing else. Output and every cache array equal the general
    path's (store_kv + attention_any) bit for bit, a second run of the same step is identical,
    and it matches the reference. The prompt is the window and 128 positions more; with blocks
    of 64 the four steps after it end with a commit (a 128-row window: positions 196-259 leave
    the FP16 rows). With 128-row chunks the first step gives back the ring's room for them
    (`window.fit`) before the step is planned, as the general path's write does."""
    _one_launch_steps(kv, batch, d, commit, window, chunk, mx.float16)


@pytest.mark.skipif(BACKEND != "cuda", reason="the tensor-core decode kernel is CUDA-only")
@pytest.mark.parametrize("kv,batch,d", [("tq4", 1, 128), ("k8v4", 2, 64)])
def test_protected_decode_step_with_float32_rows(kv, batch, d):
    """The same with the FP16 rows stored as float32 (a float32 model's cache, `model_dtype`):
    one launch per step, equal to the general path and close to the reference."""
    _one_launch_steps(kv, batch, d, 64, 128, 128, mx.float32)


def _one_launch_steps(kv, batch, d, commit, window, chunk, dtype):
    import copy

    from turbospark_mlx.attention import store_and_attend

    mx.random.seed(9)
    # Windows of 128 rows (k8v4's) and 256 (tq4's; tq3 ships 512): the four steps read codes
    # with either block size.
    config = get_preset(kv).with_(window_rows=window, commit_rows=commit)
    fast = KVCacheManager([LayerSpec(2, d)], config, batch_size=batch, max_rows=chunk, dtype=dtype)
    starts = mx.array([0, 5]) if batch == 2 else 0
    pos = 0
    for m in [chunk] * ((window + 128) // chunk):
        k = (mx.random.normal((batch, 2, m, d)) + 3 * mx.random.normal((1, 2, 1, d))).astype(dtype)
        v = mx.random.normal((batch, 2, m, d)).astype(dtype)
        with use_backend(BACKEND):
            store_kv(fast, 0, pos, k, v)
        pos += m
    general = copy.deepcopy(fast)
    seen = set()
    for _ in range(4):
        q = mx.random.normal((batch, 8, 1, d)).astype(dtype)
        k = (mx.random.normal((batch, 2, 1, d)) + 3).astype(dtype)
        v = mx.random.normal((batch, 2, 1, d)).astype(dtype)
        twin = copy.deepcopy(fast)
        build.LAUNCHES.clear()
        with use_backend(BACKEND):
            out = store_and_attend(fast, 0, q, k, v, pos, sinks=mx.ones((8,)), kv_start=starts)
            commits = config.committed_end(pos + 1) > config.committed_end(pos)
            launches = {"tq_commit": 1, "tq_decode_mma": 1} if commits else {"tq_decode_mma": 1}
            assert dict(build.LAUNCHES) == launches, (pos, dict(build.LAUNCHES))
            seen.add(commits)
            again = store_and_attend(twin, 0, q, k, v, pos, sinks=mx.ones((8,)), kv_start=starts)
            store_kv(general, 0, pos, k, v)
            want = attention_any(general, 0, q, pos, sinks=mx.ones((8,)), kv_start=starts)
        with use_backend("reference"), mx.stream(mx.cpu):
            ref = attention_any(general, 0, q, pos, sinks=mx.ones((8,)), kv_start=starts)
        assert mx.array_equal(out, again).item() and mx.array_equal(out, want).item()
        assert fast.layer_offset(0) == general.layer_offset(0) == pos + 1
        for name, a in fast.layer_arrays(0).items():
            assert mx.array_equal(a, general.layer_arrays(0)[name]).item(), name
        assert rel_l2(out, ref) < 5e-3, rel_l2(out, ref)
        assert fast.recent_capacity(0) == config.uncommitted_rows + 64
        pos += 1
    assert seen == ({True} if commit == 1 else {True, False})


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_dequantize_kernel_matches_ref(d, bits):
    side = side_quant(bits, d, "auto", 3, 1, "v")
    x = 3 * mx.random.normal((2, 3, 37, d))
    codes, norms = quantize_ref(x, side)
    mean = mx.random.normal((2, 3, d))
    for n, m, dtype in ((37, None, mx.float32), (29, mean, mx.float32), (37, mean, mx.bfloat16)):
        out = tq_dequantize(codes, norms, side, n, dtype, m, backend=BACKEND)
        with mx.stream(mx.cpu):
            ref = tq_dequantize(codes, norms, side, n, dtype, m, backend="reference")
        assert out.shape == (2, 3, n, d) and out.dtype == dtype
        assert rel_l2(out, ref) < (1e-5 if dtype == mx.float32 else 5e-3), (n, dtype)
        again = tq_dequantize(codes, norms, side, n, dtype, m, backend=BACKEND)
        assert mx.array_equal(out, again).item()


@pytest.mark.parametrize("path", ["fused", "blocks"])
@pytest.mark.parametrize("kv,d", [("tq4", 128), ("k8v4", 64), ("tq3", 128), ("plain-tq4", 128)])
def test_prefill_path_matches_its_oracle(kv, d, path, monkeypatch):
    """Chunks of >= PREFILL_MIN_ROWS rows on a GPU read the history decoded by tq_dequantize
    (and a protected layer's ring from its committed end on) under MLX's fused attention,
    the whole chunk in one call ("fused"), or, where MLX has no fused kernel (made to refuse
    here), in query blocks of 20 to 40 rows ("blocks"): equal, up to bf16 rounding, to dense
    attention over the same rows built on the CPU."""
    sdpa, calls = mx.fast.scaled_dot_product_attention, []

    def spy(q, k, v, *, force_fused=False, **kw):
        calls.append((q.shape[2], force_fused))
        if path == "blocks" and force_fused:
            raise ValueError("no fused kernel (made to refuse by the test)")
        return sdpa(q, k, v, force_fused=force_fused, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_module, "PREFILL_SCORE_BYTES", 4 * 8 * 256 * 20)
    config = get_preset("tq4").plain() if kv == "plain-tq4" else get_preset(kv).with_(name="p", window_rows=16)
    M = PREFILL_MIN_ROWS
    mx.random.seed(3)
    cache = KVCacheManager([LayerSpec(2, d)], config, max_rows=M, dtype=mx.bfloat16)
    for pos in range(0, 4 * M, M):
        k = (mx.random.normal((1, 2, M, d)) + 4 * mx.random.normal((1, 2, 1, d))).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, M, d)).astype(mx.bfloat16)
        with use_backend(BACKEND):
            store_kv(cache, 0, pos, k, v)
        q = mx.random.normal((1, 8, M, d)).astype(mx.bfloat16)
        with use_backend(BACKEND):
            out = attention_any(cache, 0, q, pos, sinks=mx.ones((8,)))
            again = attention_any(cache, 0, q, pos, sinks=mx.ones((8,)))
        ref = prefill_reference(cache, 0, q, pos, sinks=mx.ones((8,)))
        end = pos + M
        assert mx.array_equal(out, again).item()
        assert rel_l2(out, ref) < 1e-2, (pos, rel_l2(out, ref))
        expected = [(M, True)]  # per attention_any call: the whole chunk, fused
        if path == "blocks":  # refused, then blocks of the budget's rows
            block = max(16, 4 * 8 * 256 * 20 // (4 * 8 * end))
            expected += [(min(block, M - i), False) for i in range(0, M, block)]
        assert calls == 2 * expected, (pos, calls)
        calls.clear()


@pytest.mark.parametrize("kb,vb,d", [(4, 4, 128), (8, 4, 64), (3, 3, 96)])
def test_commit_kernel_matches_ref(kb, vb, d):
    """tq_commit (K and V leaving a protected layer's window, one launch) equals quantize_ref
    on the same ring rows, centred keys included, for a range that wraps around the ring."""
    from turbospark_mlx.cache.window import ring_rows
    from turbospark_mlx.gpu.quantize import tq_commit

    quant, cap = _quant(kb, vb, d), 40
    k_ring = (2 * mx.random.normal((2, 3, cap, d)) + 1).astype(mx.bfloat16)
    v_ring = mx.random.normal((2, 3, cap, d)).astype(mx.bfloat16)
    mean = mx.random.normal((2, 3, d))
    for first, n, k_mean in ((5, 1, mean), (70, 17, mean), (3, 9, None)):
        out = tq_commit(k_ring, v_ring, first, n, quant, cap, k_mean, backend=BACKEND)
        again = tq_commit(k_ring, v_ring, first, n, quant, cap, k_mean, backend=BACKEND)
        with mx.stream(mx.cpu):
            kx = ring_rows(k_ring, first, first + n, cap).astype(mx.float32)
            ref = [*quantize_ref(kx if k_mean is None else kx - k_mean[:, :, None], quant.k),
                   *quantize_ref(ring_rows(v_ring, first, first + n, cap), quant.v)]
        for a, b, c, bits in zip(out, ref, again, (kb, 0, vb, 0)):
            assert a.shape == b.shape and mx.array_equal(a, c).item()
            if bits == 0:
                assert mx.allclose(a, b, rtol=1e-5, atol=0).item()
            else:
                diff = np.abs(np.asarray(unpack_indices(a, bits, d)).astype(np.int64)
                              - np.asarray(unpack_indices(b, bits, d)).astype(np.int64))
                assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3, (first, n, (diff > 0).sum())
