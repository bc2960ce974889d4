# Build tq_decode_mma from another kernel file (optionally with phase stamps), same inputs.
import sys, tempfile, hashlib
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, str(Path.cwd()))
import turbospark_mlx.tq_kernels as tk
import turbospark_mlx.kernel_build as kb

STAMP = ('#define STAMP(k) do { if (threadIdx.x == 0) { unsigned long long t_; '
         'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); '
         'size_t o_ = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 32; '
         'stamps[o_ + (k)] = t_; stamps[o_ + 16 + (k)] = clock64(); } } while (0)\n')
# (anchor text, stamp index, where): first match wins per index
ANCHORS = [
    ("const int start = ", 0, "after_line"),
    ("__syncthreads();\n#pragma unroll 8", 1, "after_sync"),     # old: after q fill
    ("ts_cp_wait<STAGES - 1>();  // this thread's table", 1, "before"),  # new: set-up loads issued, q' done
    ("// Tables, one column per lane", 1, "before"),
    ("// Rows go to fp16", 2, "before"),
    ("// q' = Π_K q, one row per warp", 2, "before"),
    ("// B fragments of Q'^T", 3, "before"),
    ("  Tile cur;\n", 4, "loop"),
    ("ts_cp_wait<0>();  // the merge", 5, "before"),
    ("// The last block of this", 6, "before"),
    ("if (!is_last) return;", 7, "before"),
    ("// A thread's NO outputs", 8, "before"),
    ("  // The splits' loads are independent", 8, "before"),
    ("if (VROT == 0) ts_fwht<D, RP, NT>(ob, tid);", 9, "before"),
    ("  OT* orow = out +", 9, "before"),
]

def stamped(src: str) -> str:
    done = set()
    for a, k, how in ANCHORS:
        if k in done: continue
        i = src.find(a)
        if i < 0: continue
        done.add(k)
        if how == "after_line":
            j = src.index("\n", i) + 1; src = src[:j] + f"STAMP({k});\n" + src[j:]
        elif how == "after_sync":
            j = i + len("__syncthreads();\n"); src = src[:j] + f"STAMP({k});\n" + src[j:]
        elif how == "loop":
            src = src[:i] + f"  if (kb == kbeg) STAMP({k});\n" + src[i:]
        else:
            src = src[:i] + f"STAMP({k});\n" + src[i:]
    # Thread 0 zeroes its block's 32 slots first, so no init_value (a fill node per call) is needed.
    zero = ('if (threadIdx.x == 0) { size_t z_ = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 32; '
            'for (int i_ = 0; i_ < 32; i_++) stamps[z_ + i_] = 0; }\n')
    i = src.index("STAMP(0);")
    src = src[:i] + zero + src[i:]
    return STAMP + src + "\nSTAMP(10);\n"

_tmp = Path(tempfile.mkdtemp())

def make(kfile, cfg, stamps=False, bounds=True):
    src = Path(kfile).read_text()
    if stamps: src = stamped(src)
    tag = hashlib.sha1(src.encode()).hexdigest()[:10]
    f = _tmp / f"k_{tag}.kernel"; f.write_text(src)
    header, name = kb.cuda_header("tq_decode_mma", cfg.template), kb._cuda_parts("tq_decode_mma")[2]
    if not bounds:  # without the build's __launch_bounds__ (kernel_build._cuda_launch_bounds)
        header, name = kb._cuda_parts("tq_decode_mma")[0], name + "_nolb"
    orig = (kb.kernels_dir() / "tq_decode_mma.kernel").resolve().as_posix()
    body = kb.cuda_body("tq_decode_mma", cfg.template).replace(orig, f.as_posix())
    spec = kb._check("cuda", "tq_decode_mma")
    return mx.fast.cuda_kernel(name=f"{name}_{tag}", input_names=list(spec.inputs),
                               output_names=list(spec.outputs) + (["stamps"] if stamps else []),
                               source=body, header=header, shared_memory=cfg.smem)

def call(kern, cfg, splits, q, kc, kn, vc, vn, L, Hkv, stamps=False):
    """[out, None] (None where sessions <= 11 returned the partials), then the stamps if asked."""
    B, Hq, M, D = q.shape
    shapes, dts = [(B, Hq, M, D)], [q.dtype]
    if stamps:
        shapes.append((B * Hkv * splits * 32,)); dts.append(mx.uint64)
    chain = tk._mma_chain(q.dtype, B * Hkv * splits * (cfg.R * D + 2 * cfg.RP))
    # The codes as bytes, as tq_kernels._MmaLaunch passes them (session 13).
    outs = kern(inputs=[q, kc.view(mx.uint8), kn, vc.view(mx.uint8), vn, *cfg.tables, tk._sinks_arg(None), *tk._step_args(L - M, 0, B), *chain],
                grid=(32 * cfg.nwarp * splits, B * Hkv, 1), threadgroup=(32 * cfg.nwarp, 1, 1),
                output_shapes=shapes, output_dtypes=dts)
    chain[1] = outs[0]
    return [outs[0], None, *outs[1:]]


def stamped_chain(kern, cfg, splits, q0, kc, kn, vc, vn, L, Hkv, n):
    """n stamped calls chained in one eval: (build us, eval us) per call, and per call its
    first block's start and last block's end (globaltimer ns) and every block's stamps."""
    import time
    import numpy as np
    x, sts = q0, []
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x, _, s = call(kern, cfg, splits, x, kc, kn, vc, vn, L, Hkv, stamps=True)
        sts.append(s)
    t1 = time.perf_counter()
    mx.eval(x, *sts)
    mx.synchronize()
    t2 = time.perf_counter()
    g = [np.array(s).reshape(-1, 32)[:, :16].astype(np.int64) for s in sts]
    start = np.array([a[:, 0].min() for a in g])
    end = np.array([a[:, 10].max() for a in g])
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, start, end, g

