# Chained timings (20 calls per eval; build and eval us per call), kernel files vs SDPA, interleaved.
import sys, time, statistics, json, os
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
import mk  # noqa: E402
from mk import tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

from chained_timing_lib import random_layer, st  # noqa: E402

files = sys.argv[1:]
D, Hq, Hkv = (256, 4, 1) if os.environ.get("SHAPE") == "gemma" else (128, 32, 8)
res = []
PRESETS = os.environ.get("PRESETS", "tq4,tq3").split(",")  # e.g. PRESETS=tq4
for preset, kbits, vbits in [p for p in (("tq4", 4, 4), ("tq3", 3, 3), ("k8v4", 8, 4)) if p[0] in PRESETS]:
  quant = LayerQuant(0, side_quant(kbits, D, "auto", 0, 0, "k"), side_quant(vbits, D, "auto", 0, 0, "v"))
  for L in (64, 4096, 32768, 131072):
    q0, kc, kn, vc, vn, k, v = random_layer(quant, L, Hq, Hkv, D)
    cfg = tk._mma_config(quant, 4, 1, D, D ** -0.5, False, False, mx.float16)
    fns = {"sdpa": lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5),
           "wrapper": lambda q: tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1)}
    meta = {}
    for kf in files:
        # FILE%nopl: that file with MMA_PRMT_LOOKUPS off; FILE%w16: MMA_WARPS 16 (non-PL variants);
        # FILE%w8: PL at 8 warps; FILE%w12: 12 warps; FILE%nolb: no __launch_bounds__; FILE@KB: MMA_RING_BYTES KB
        name, _, flags = kf.partition("%")
        kf, _, ring = name.partition("@")
        saved = tk.MMA_RING_BYTES, getattr(tk, "MMA_PRMT_LOOKUPS", False), tk.MMA_WARPS, tk._mma_regs
        if ring: tk.MMA_RING_BYTES = int(ring) * 1024
        if flags == "nopl": tk.MMA_PRMT_LOOKUPS = False
        if flags == "w16": tk.MMA_WARPS = 16
        if flags == "w8": tk._mma_regs = lambda *a: 255  # PL at 8 warps (ptxas may use 255 registers)
        if flags == "w12": tk.MMA_WARPS = 6  # 12 warps where 16 would be chosen (up to 168 registers)
        c = tk._mma_config_uncached(quant, 4, 1, D, D ** -0.5, False, False, mx.float16)
        sp = tk._mma_splits(c, -(-L // 16), Hkv)
        tk.MMA_RING_BYTES, tk.MMA_PRMT_LOOKUPS, tk.MMA_WARPS, tk._mma_regs = saved
        kern = mk.make(kf, c, bounds=flags != "nolb")
        meta[Path(kf).stem + (f"@{ring}" if ring else "") + (f"%{flags}" if flags else "")] = dict(splits=sp, nwarp=c.nwarp)
        fns[Path(kf).stem + (f"@{ring}" if ring else "") + (f"%{flags}" if flags else "")] = (lambda kern, c, sp: lambda q: mk.call(kern, c, sp, q, kc, kn, vc, vn, L, Hkv)[0])(kern, c, sp)
    splits = tk._mma_splits(cfg, -(-L // 16), Hkv)
    outs = {n: f(q0) for n, f in fns.items()}
    mx.eval(outs)
    refo = outs["wrapper"].astype(mx.float32)
    errs = {n: float(mx.abs(o.astype(mx.float32) - refo).max()) for n, o in outs.items() if n != "sdpa"}
    acc = {n: [] for n in fns}
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        for n, f in fns.items():
            acc[n].append(st(f, q0))
    row = dict(preset=preset, L=L, splits=splits, errs=errs, variants=meta)
    for n, v in acc.items():
        row[n] = dict(build=round(statistics.median(x[0] for x in v), 1), eval=round(statistics.median(x[1] for x in v), 1),
                      evals=[round(x[1], 1) for x in v])
    for n in fns:
        if n != "sdpa": row[n]["x_sdpa"] = round((row[n]["build"] + row[n]["eval"]) / (row["sdpa"]["build"] + row["sdpa"]["eval"]), 3)
    row["stages"] = {n: None for n in fns}
    print(json.dumps(row)); res.append(row)
Path(os.environ.get("OUT", "/tmp"), os.environ.get("P12", "p12.json")).write_text(json.dumps(res, indent=1))
