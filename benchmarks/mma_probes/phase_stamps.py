# Phase timestamps inside tq_decode_mma (globaltimer ns + clock64 per block, thread 0).
import sys, json, os
from pathlib import Path
import numpy as np, mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

files = sys.argv[1:]
D, Hq, Hkv = 128, 32, 8
res = {}
NAMES = {(0, 1): "ph01", (1, 2): "ph12", (2, 3): "ph23", (0, 3): "set-up", (3, 4): "first tile",
         (4, 5): "loop", (5, 6): "warp merge+part", (6, 7): "fence+ticket"}
for preset, kbits, vbits in (("tq4", 4, 4), ("tq3", 3, 3)):
  quant = LayerQuant(0, side_quant(kbits, D, "auto", 0, 0, "k"), side_quant(vbits, D, "auto", 0, 0, "v"))
  for L in (4096, 32768, 131072):
    if preset == "tq3" and L != 32768: continue
    q = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
    vc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L)); vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    mx.eval(q, kc, vc, kn, vn)
    cfg = tk._mma_config(quant, 4, 1, D, D ** -0.5, False, False, mx.float16)
    splits = tk._mma_splits(cfg, -(-L // 16), Hkv)
    ref = tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1).astype(mx.float32)
    for kf in files:
        kern = mk.make(kf, cfg, stamps=True)
        for rep in range(6):
            out, _, st = mk.call(kern, cfg, splits, q, kc, kn, vc, vn, L, Hkv, stamps=True)
            mx.eval(out, st)
        err = float(mx.abs(out.astype(mx.float32) - ref).max())
        nb = splits * Hkv
        a = np.array(st).reshape(nb, 32).astype(np.int64)
        g, c = a[:, :16], a[:, 16:]
        t0 = g[:, 0].min()
        last = g[:, 8] > 0
        ph = {}
        for (x, y), nm in NAMES.items():
            if (g[:, x] > 0).all() and (g[:, y] > 0).all():
                ph[nm] = dict(ns_med=float(np.median(g[:, y] - g[:, x])), ns_max=int((g[:, y] - g[:, x]).max()),
                              cyc_med=float(np.median(c[:, y] - c[:, x])))
        lb = np.where(last)[0]
        for x, y, nm in ((7, 8, "last: row pass"), (8, 9, "last: accumulate"), (9, 10, "last: fwht+out"), (7, 10, "last: all")):
            ph[nm] = dict(ns=[int(v) for v in (g[lb, y] - g[lb, x])], cyc=[int(v) for v in (c[lb, y] - c[lb, x])])
        r = dict(file=Path(kf).name, L=L, preset=preset, splits=splits, blocks=nb, maxerr_vs_committed=err,
                 start_skew_ns=dict(med=float(np.median(g[:, 0] - t0)), max=int((g[:, 0] - t0).max())),
                 ticket_ns=dict(med=float(np.median(g[:, 7] - t0)), max=int((g[:, 7] - t0).max())),
                 kernel_span_ns=int(g[:, 10].max() - t0), phases=ph)
        res[f"{Path(kf).stem}_{preset}_{L}"] = r
        print(json.dumps(r))
Path(os.environ.get("OUT", "/tmp"), "stamps.json").write_text(json.dumps(res, indent=1))
