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
