# Where a chained call's time goes on the GPU: 20 stamped tq_decode_mma calls in one eval
# (each call's query is the previous call's output), globaltimer stamps per block; per call
# the kernel span (first block start to last block end) and the gap to the next call's start.
import sys, json, os, statistics
from pathlib import Path
import numpy as np, mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

files = sys.argv[1:] or ["kernels/tq_decode_mma.kernel"]
D, Hq, Hkv, N = 128, 32, 8, 20
res = []
for preset, kbits, vbits in (("tq4", 4, 4), ("tq3", 3, 3)):
    quant = LayerQuant(0, side_quant(kbits, D, "auto", 0, 0, "k"), side_quant(vbits, D, "auto", 0, 0, "v"))
    for L in (64, 4096, 32768, 131072):
        q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
        kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
        vc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
        kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
        vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
        mx.eval(q0, kc, vc, kn, vn)
        cfg = tk._mma_config(quant, 4, 1, D, D**-0.5, False, False, mx.float16)
        splits = tk._mma_splits(cfg, -(-L // 16), Hkv)
        for kf in files:
            kern = mk.make(kf, cfg, stamps=True)
            rows = []
            for rep in range(8):
                build, ev, start, end, g = mk.stamped_chain(kern, cfg, splits, q0, kc, kn, vc, vn, L, Hkv, N)
                rows.append(
                    dict(
                        build_us=build,
                        eval_us=ev,
                        span_us=float(np.median(end - start)) / 1e3,
                        gap_us=float(np.median(start[1:] - end[:-1])) / 1e3,
                        period_us=float(np.median(np.diff(start))) / 1e3,
                        loop_med_us=float(np.median(np.concatenate([a[:, 5] - a[:, 4] for a in g]))) / 1e3,
                        loop_max_us=float(np.median([(a[:, 5] - a[:, 4]).max() for a in g])) / 1e3,
                        to_loop_us=float(np.median([a[:, 4].min() - a[:, 0].min() for a in g])) / 1e3,
                        after_loop_us=float(np.median([a[:, 10].max() - a[:, 5].max() for a in g])) / 1e3,
                    )
                )
            r = dict(
                file=Path(kf).name,
                preset=preset,
                L=L,
                splits=splits,
                nwarp=cfg.nwarp,
                **{k: round(statistics.median(x[k] for x in rows[2:]), 2) for k in rows[0]},
            )
            print(json.dumps(r))
            res.append(r)
Path(os.environ.get("OUT", "/tmp"), "chain_gaps.json").write_text(json.dumps(res, indent=1))
