# A/B of tq_decode_mma's ticket views: made and evaluated with the ring (now) vs made on
# first use (session 8): chained build + eval us per call, tq4 llama shape, interleaved rounds.
import json, os, statistics, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path(__file__).parent))
from chained_timing_lib import st  # noqa: E402
import turbospark_mlx.tq_kernels as tk
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant

new_ticket = tk._ticket_arg
_lazy = {}
def lazy_ticket(n):  # session 8's: each region's view sliced on first use
    if n not in _lazy:
        _lazy[n] = [tk._resident(mx.zeros((tk.MMA_TICKET_CALLS * n,), mx.uint32)), [None] * tk.MMA_TICKET_CALLS, 0]
    st_ = _lazy[n]
    ring, views, i = st_
    st_[2] = (i + 1) % len(views)
    if views[i] is None:
        views[i] = ring[i * n : (i + 1) * n]
    return views[i]

D, Hq, Hkv = 128, 32, 8
quant = LayerQuant(0, side_quant(4, D, "auto", 0, 0, "k"), side_quant(4, D, "auto", 0, 0, "v"))
res = []
for L in (64, 4096, 32768):
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
    vc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L)); vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    mx.eval(q0, kc, vc, kn, vn)
    f = lambda q: tk.tq_decode_mma(q, kc, kn, vc, vn, quant, scale=D ** -0.5, position=L - 1)
    acc = {"evaluated_views": [], "lazy_views": []}
    for rnd in range(3):
        for name, fn in (("evaluated_views", new_ticket), ("lazy_views", lazy_ticket)):
            tk._ticket_arg = fn
            if n_ := _lazy.get(8):  # the lazy ring's views made anew each round, as in a benchmark run
                n_[1] = [None] * tk.MMA_TICKET_CALLS
            acc[name].append(st(f, q0))
    tk._ticket_arg = new_ticket
    row = dict(L=L, **{n: dict(build=round(statistics.median(x[0] for x in v), 2), eval=round(statistics.median(x[1] for x in v), 2)) for n, v in acc.items()})
    print(json.dumps(row), flush=True); res.append(row)
Path(os.environ.get("OUT", "/tmp"), "ticket_ab.json").write_text(json.dumps(res, indent=1))
