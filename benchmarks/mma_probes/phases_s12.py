# Session 12: where a tq_decode_mma launch's time goes outside its main loop (stamped kernel,
# mk.py's anchors; thread 0 of each block, i.e. warp 0): per call, median over blocks of each
# phase, and the phases of the block that finishes last. tq4 and tq3, llama shape, 128k keys
# (L= another count; KERNEL= another kernel file).
import json, os, sys
from pathlib import Path
import numpy as np, mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from chained_timing_lib import random_layer  # noqa: E402
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

D, Hq, Hkv, N = 128, 32, 8, 20
L = int(os.environ.get("L", "131072"))
NAMES = {0: "start", 1: "tables", 2: "q'", 3: "qfrag", 4: "loop0", 5: "loop_end", 6: "partial_written",
         7: "ticket", 8: "ml_pass", 9: "o_pass", 10: "end",
         # stamps a kernel file may carry by hand (session 13: finesetup.kernel)
         11: "s11", 12: "s12", 13: "s13", 14: "s14", 15: "s15"}
res = {}
for preset, bits in (("tq4", 4), ("tq3", 3)):
    quant = LayerQuant(0, side_quant(bits, D, "auto", 0, 0, "k"), side_quant(bits, D, "auto", 0, 0, "v"))
    q0, kc, kn, vc, vn, k, v = random_layer(quant, L)
    cfg = tk._mma_config(quant, 4, 1, D, D**-0.5, False, False, mx.float16)
    splits = tk._mma_splits(cfg, -(-L // 16), Hkv)
    kern = mk.make(os.environ.get("KERNEL", "kernels/tq_decode_mma.kernel"), cfg, stamps=True)
    allb, lastb = [], []
    for rep in range(6):
        _, _, _, _, g = mk.stamped_chain(kern, cfg, splits, q0, kc, kn, vc, vn, L, Hkv, N)
        if rep < 2:
            continue
        for a in g:
            a = a[:, :16]
            rel = np.where(a > 0, a - a[:, 0].min(), -1)  # -1: stamp absent (a block that is not last)
            allb.append(rel)
            lastb.append(rel[np.argmax(a[:, 10])])
    allb = np.concatenate(allb)
    out = {"splits": splits, "median_block_us": {}, "last_block_us": {}}
    for k_, n_ in NAMES.items():
        col = allb[:, k_]
        col = col[col >= 0]
        if col.size:
            out["median_block_us"][n_] = round(float(np.median(col)) / 1e3, 2)
            out["p90_block_us"] = out.get("p90_block_us", {})
            out["p90_block_us"][n_] = round(float(np.percentile(col, 90)) / 1e3, 2)
        lc = np.array([r[k_] for r in lastb])
        lc = lc[lc >= 0]
        if lc.size:
            out["last_block_us"][n_] = round(float(np.median(lc)) / 1e3, 2)
    res[preset] = out
    print(preset, json.dumps(out))
tag = Path(os.environ.get("KERNEL", "")).stem
Path(os.environ.get("OUT", "/tmp"), f"phases_s12_{L}{'_' + tag if tag else ''}.json").write_text(json.dumps(res, indent=1))
