"""CPU checks of the decode kernels' host side: launch plans, the tensor-core kernel's
launch cache and scratch chain, and the automatic kernel choice."""

from __future__ import annotations

import mlx.core as mx

from turbospark_mlx.gpu import build, decode, decode_mma
from turbospark_mlx.quant.tables import LayerQuant, side_quant


def _quant(kb: int, vb: int, d: int) -> LayerQuant:
    return LayerQuant(0, side_quant(kb, d, "auto", 0, 0, "k"), side_quant(vb, d, "auto", 0, 0, "v"))


def test_mma_launches_share_a_scratch_in_order(monkeypatch):
    """tq_decode_mma's launches of one output dtype share a scratch (tickets, then partials),
    so each takes the last one's output as an input (a dependency MLX keeps in order): the
    first takes a zero of its dtype; the scratch grows, zeroed, when a launch needs more; a
    dtype of its own gets a scratch of its own. The kernel object is replaced by a recorder."""
    monkeypatch.setattr(decode_mma, "_MMA_CHAIN", {})
    names = build.SPECS["tq_decode_mma"].inputs
    quant = _quant(4, 4, 128)
    kc = mx.zeros((1, 8, 70_000, quant.k.words), mx.uint32)
    kn = mx.zeros((1, 8, 70_000), mx.float32)
    calls = []

    def record(**kw):
        calls.append(dict(zip(names, kw["inputs"], strict=True)))
        return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]

    outs = []
    for dtype, pos in ((mx.float16, 4095), (mx.float16, 4095), (mx.float16, 65_000), (mx.float32, 4095)):
        q = mx.zeros((1, 32, 1, 128), dtype)
        launch = decode_mma.mma_launch(quant, q, 8, 128**-0.5, False, False)
        monkeypatch.setattr(launch, "_kernel", record)
        outs.append(decode_mma.tq_decode_mma(q, kc, kn, kc, kn, quant, scale=128**-0.5, position=pos))
        plan = decode_mma.mma_plan(quant, 4, 1, 128, 8, pos + 1, scale=128**-0.5, has_starts=False,
                        has_sink=False, out_dtype=dtype)
        need = decode_mma.MMA_TICKET_WORDS + 8 * plan["splits"] * (plan["R"] * 128 + 2 * plan["RP"])
        scratch = calls[-1]["scratch"]
        assert scratch.dtype == mx.uint32 and scratch.size >= need
        assert not mx.any(scratch[: decode_mma.MMA_TICKET_WORDS]).item()
    first, second, third, other = calls
    assert first["after"].dtype == mx.float16 and not mx.any(first["after"]).item()
    assert second["after"] is outs[0] and third["after"] is outs[1]
    assert first["scratch"] is second["scratch"] is third["scratch"]
    assert other["scratch"] is not third["scratch"] and other["after"].dtype == mx.float32
    # A launch that needs more partials than the scratch holds: a new, zeroed scratch; the
    # chain goes on from the last output.
    chain = decode_mma._MMA_CHAIN[mx.float16]
    assert chain[1] is outs[2]
    grown = decode_mma._mma_chain(mx.float16, 4 * chain[0].size)
    assert grown[0] is not third["scratch"] and grown[1] is outs[2]
    assert grown[0].size >= decode_mma.MMA_TICKET_WORDS + 4 * third["scratch"].size
    assert not mx.any(grown[0]).item()


def test_automatic_choice_on_cuda(monkeypatch):
    """On CUDA the automatic choice takes the tensor-core kernel from MMA_AUTO_MIN_CONTEXT keys
    on at the head dims it serves, and the dialect kernels otherwise, without looking a
    tensor-core launch up for short contexts (one more lookup per layer and step). Both kernel
    calls are replaced by recorders (no GPU here)."""
    monkeypatch.setattr(decode_mma, "_MMA_CHAIN", {})
    dialect, mma, lookups = [], [], []

    def fake_launch(op, backend, template, **kw):
        dialect.append(op)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    def record(**kw):
        mma.append(kw)
        return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]

    real_lookup = decode_mma.mma_launch

    def lookup(*a, **kw):
        launch = real_lookup(*a, **kw)
        lookups.append(launch)
        launch._kernel = record
        return launch

    monkeypatch.setattr(decode, "launch", fake_launch)
    monkeypatch.setattr(decode, "mma_launch", lookup)
    for d, pos, want in ((128, decode_mma.MMA_AUTO_MIN_CONTEXT - 1, "mma"), (128, 100, "dialect"), (96, 9000, "dialect")):
        quant = _quant(4, 4, d)
        q = mx.zeros((1, 32, 1, d), mx.float16)
        kc = mx.zeros((1, 8, 10_000, quant.k.words), mx.uint32)
        kn = mx.zeros((1, 8, 10_000), mx.float32)
        n_dialect, n_mma, n_lookups = len(dialect), len(mma), len(lookups)
        out = decode.tq_decode_attention(q, kc, kn, kc, kn, quant, scale=d**-0.5, position=pos, backend="cuda")
        assert out.shape == (1, 32, 1, d)
        assert (len(mma) - n_mma, len(dialect) - n_dialect) == ((1, 0) if want == "mma" else (0, 2))
        assert len(lookups) - n_lookups == (0 if pos + 1 < decode_mma.MMA_AUTO_MIN_CONTEXT else 1)


def test_mma_launch_cache_matches_the_plan(monkeypatch):
    """tq_decode_mma caches each call shape's launch (MmaLaunch): per step it must still
    launch what mma_plan says for that context (grid from the split count, a scratch with room
    for its partials), with the step's position and kv_start as lengths.
    The kernel object is replaced by a recorder (no GPU here)."""
    quant = _quant(4, 4, 128)
    q = mx.zeros((1, 32, 1, 128), mx.float16)
    kc = mx.zeros((1, 8, 70_000, quant.k.words), mx.uint32)
    kn = mx.zeros((1, 8, 70_000), mx.float32)
    launch = decode_mma.mma_launch(quant, q, 8, 128**-0.5, False, False)
    calls = []

    def record(**kw):
        calls.append(kw)
        return kw["inputs"][0], None

    monkeypatch.setattr(launch, "_kernel", record)
    for pos, start in ((4095, 0), (32767, 7), (65_000, 0), (4095, 0)):
        out = decode_mma.tq_decode_mma(
            q, kc, kn, kc, kn, quant, scale=128**-0.5, position=pos, kv_start=start
        )
        assert out is q
        plan = decode_mma.mma_plan(
            quant,
            4,
            1,
            128,
            8,
            pos + 1,
            scale=128**-0.5,
            has_starts=False,
            has_sink=False,
            out_dtype=mx.float16,
        )
        kw = calls[-1]
        assert kw["grid"] == (32 * plan["nwarp"] * plan["splits"], 8, 1)
        assert kw["threadgroup"] == (32 * plan["nwarp"], 1, 1)
        assert kw["output_shapes"] == [(1, 32, 1, 128)]
        args = dict(zip(build.SPECS["tq_decode_mma"].inputs, kw["inputs"], strict=True))
        parts = 8 * plan["splits"] * (plan["R"] * 128 + 2 * plan["RP"])  # partials, after the tickets
        assert args["scratch"].size >= decode_mma.MMA_TICKET_WORDS + parts
        assert args["qpos"].shape == (pos + 1,) and args["kv0"].shape == (start + 1,)
        assert args["tables"] is launch.tables  # the layer's four tables, one input made once
        # The codes go as bytes, so MLX sizes its CUDA graphs by what the kernel reads.
        for name in ("k_bytes", "v_bytes"):
            assert args[name].dtype == mx.uint8 and args[name].shape == (1, 8, 70_000, 4 * quant.k.words)
    assert decode_mma.mma_launch(quant, q, 8, 128**-0.5, False, False) is launch
    assert decode_mma.mma_launch(quant, q, 8, 128**-0.5, True, False) is not launch


def test_mma_shared_memory_fits_one_block_on_sm90():
    """Every tq_decode_mma variant asks for at most the 227 KB of dynamic shared memory an
    sm_90 block may have (more fails the launch: cuGraphAddKernelNode "invalid argument"):
    PL's byte-indexed tables fall back to packed ones where they would not fit."""
    limit = decode_mma.MMA_SM_SHARED - decode_mma.MMA_BLOCK_SHARED_RESERVED
    pl_seen = set()
    for kb in (2, 3, 4, 8):
        for vb in (2, 3, 4, 8):
            for d in (64, 128, 256):
                for g, m in ((1, 1), (4, 1), (8, 1), (16, 1), (4, 4)):
                    plan = decode_mma.mma_plan(
                        _quant(kb, vb, d), g, m, d, 8, 131072,
                        scale=d**-0.5, has_starts=False, has_sink=False, out_dtype=mx.float16,
                    )
                    assert plan["smem"] <= limit, (kb, vb, d, g, m, plan["smem"])
                    pl_seen.add(dict(plan["template"])["PL"])
    assert pl_seen == {True, False}


def test_mma_launch_with_fp16_rows(monkeypatch):
    """A protected layer's tq_decode_mma launch (DENSE): R more blocks per (b, KV head) in x for
    the FP16 rows, a scratch with room for their partials after the splits', the sink rows,
    ring and key mean as inputs, and the tile count from the last row's committed code end.
    Where the FP16 blocks would spill out of the splits' wave, the splits make room for them
    if that costs at most MMA_DENSE_WAVE_TILES more tiles per warp: at 4k keys (llama shape)
    everything fits one wave, at 128k the splits are those of a plain launch."""
    quant = _quant(4, 4, 128)
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    S, W, B, ring_slots = 4, 128, 64, 128 + 63 + 2048
    dense = (S, W, ring_slots, True)
    kc = mx.zeros((1, 8, 140_000, quant.k.words), mx.uint32)
    kn = mx.zeros((1, 8, 140_000), mx.float32)
    rows = [mx.zeros((1, 8, S, 128), mx.bfloat16)] * 2 + [mx.zeros((1, 8, ring_slots, 128), mx.bfloat16)] * 2
    rows.append(mx.zeros((1, 8, 128), mx.float32))
    launch = decode_mma.mma_launch(quant, q, 8, 128**-0.5, False, False, dense=dense, commit_rows=B)
    plain = decode_mma.mma_launch(quant, q, 8, 128**-0.5, False, False)
    assert launch is not plain and launch.dense_blocks == 4  # R = 4 query heads per KV head
    calls = []

    def record(**kw):
        calls.append(kw)
        return kw["inputs"][0], None

    monkeypatch.setattr(launch, "_kernel", record)
    wave = decode_mma.MMA_SMS * min(launch.cfg.per_sm, decode_mma.MMA_BLOCKS_PER_SM)
    for position in (4096, 4096 + 63, 131_072):
        first = position - W - S  # the kernel's pos0: row t reads the code slots below c(t + 1) - S
        launch(q, kc, kn, kc, kn, first, 0, None, dense_rows=rows)
        kw = calls[-1]
        code_end = (first + 1) // B * B
        splits = decode_mma._mma_splits(launch.cfg, -(-code_end // 16), 8, None, 4)
        assert kw["grid"] == (32 * launch.cfg.nwarp * (splits + 4), 8, 1)
        args = dict(zip(build.SPECS["tq_decode_mma"].inputs, kw["inputs"], strict=True))
        partials = 8 * (splits * (4 * 128 + 2 * 8) + 4 * (128 + 3))
        assert args["scratch"].size >= decode_mma.MMA_TICKET_WORDS + partials
        names = ("k_sinks", "v_sinks", "k_recent", "v_recent", "k_mean")
        assert all(args[n] is a for n, a in zip(names, rows))
        assert args["qpos"].shape == (first + 1,)
        if position < 8192:
            assert 8 * (splits + 4) <= wave, splits
        else:
            assert splits == decode_mma._mma_splits(plain.cfg, -(-code_end // 16), 8)
    assert dict(launch.cfg.template)["DENSE"] and not dict(plain.cfg.template)["DENSE"]
