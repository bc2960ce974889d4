# The chained timing loop shared by the probes: n calls chained in one eval, reps evals.
import statistics, time
import mlx.core as mx


def st(fn, x0, n=20, reps=60):
    """(median build us, median eval us) per call."""
    mx.eval(fn(x0)); mx.synchronize()
    b, r = [], []
    for _ in range(reps):
        t0 = time.perf_counter(); x = x0
        for _ in range(n): x = fn(x)
        t1 = time.perf_counter(); mx.eval(x); mx.synchronize(); t2 = time.perf_counter()
        b.append((t1 - t0) / n * 1e6); r.append((t2 - t1) / n * 1e6)
    return statistics.median(b), statistics.median(r)


def build_only(fn, x0, n=2000):
    """Median us per call of building fn's graph node, never evaluated (5 runs of n calls)."""
    fn(x0)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x0)
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(ts), 2)


def random_layer(quant, L: int, Hq: int = 32, Hkv: int = 8, D: int = 128):
    """A query and a layer's cache of L keys with random codes and norms (plus FP16 K/V for
    SDPA), evaluated: (q0, k_codes, k_norms, v_codes, v_norms, k, v)."""
    q0 = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    kc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.k.words)).astype(mx.uint32)
    vc = mx.random.randint(0, 1 << 30, (1, Hkv, L, quant.v.words)).astype(mx.uint32)
    kn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    vn = mx.random.uniform(0.5, 2.0, (1, Hkv, L))
    k = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
    v = mx.random.normal((1, Hkv, L, D)).astype(mx.float16)
    mx.eval(q0, kc, vc, kn, vn, k, v)
    return q0, kc, kn, vc, vn, k, v
