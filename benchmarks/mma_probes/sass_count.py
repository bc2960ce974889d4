"""Static SASS of tq_decode_mma for one variant, compiled here with nvcc for sm_90a (what
NVRTC builds on the H200): registers, spills, and the instructions of the main loop (the
backward branch spanning the most instructions) by opcode. Needs nvcc and cuobjdump
(pip wheel nvidia-cuda-cuobjdump: CUOBJDUMP=path).

    python benchmarks/mma_probes/sass_count.py 3 3 [D G M] [--kernel FILE] [--set NAME=VALUE ...]
"""
import argparse, collections, os, re, subprocess, sys, tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "tests"))
import mlx.core as mx  # noqa: E402
import turbospark_mlx.tq_kernels as tk  # noqa: E402
import turbospark_mlx.kernel_build as kb  # noqa: E402
from turbospark_mlx.kernel_build import ArgInfo, cuda_source  # noqa: E402
from turbospark_mlx.quant.turboquant import LayerQuant, side_quant  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("kb", type=int); ap.add_argument("vb", type=int)
ap.add_argument("rest", type=int, nargs="*", help="D G M (default 128 4 1)")
ap.add_argument("--kernel", help="another tq_decode_mma.kernel file")
ap.add_argument("--set", action="append", default=[], help="tq_kernels constant NAME=VALUE")
ap.add_argument("--dump", help="write the SASS here")
a = ap.parse_args()
D, G, M = (a.rest + [128, 4, 1][len(a.rest):])[:3]
for s in a.set:
    n, v = s.split("="); setattr(tk, n, type(getattr(tk, n))(eval(v)))
q = LayerQuant(0, side_quant(a.kb, D, "auto", 0, 0, "k"), side_quant(a.vb, D, "auto", 0, 0, "v"))
plan = tk.mma_plan(q, G, M, D, 8, 131072, scale=D ** -0.5, has_starts=False, has_sink=False, out_dtype=mx.float16)
f32, u32, i32 = mx.float32, mx.uint32, mx.int32
ins = [ArgInfo(mx.float16, 4, 8 * G * M * D), ArgInfo(u32, 4, 8 * 4096 * q.k.words), ArgInfo(f32, 3, 8 * 4096),
       ArgInfo(u32, 4, 8 * 4096 * q.v.words), ArgInfo(f32, 3, 8 * 4096),
       *[ArgInfo(t.dtype, t.ndim, t.size) for t in plan["tables"]],
       ArgInfo(f32, 1, 8), ArgInfo(mx.uint8, 1, 5000), ArgInfo(mx.uint8, 1, 1), ArgInfo(i32, 1, 8), ArgInfo(u32, 1, 1 << 17), ArgInfo(mx.float16, 4, 4096)]
src = '#include "mlx_device.cuh"\n' + cuda_source("tq_decode_mma", ins, [mx.float16], plan["template"])
if a.kernel:
    src = src.replace((kb.kernels_dir() / "tq_decode_mma.kernel").resolve().as_posix(), Path(a.kernel).resolve().as_posix())
tmp = Path(tempfile.mkdtemp())
(tmp / "k.cu").write_text(src)
r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(tmp / "k.cubin"), "-Xptxas", "-v", "-expt-relaxed-constexpr",
                    f"-I{root / 'tests' / 'cuda_shim'}", str(tmp / "k.cu")], capture_output=True, text=True)
if r.returncode:
    sys.exit(r.stderr[-4000:])
regs = re.findall(r"Used (\d+) registers", r.stderr)
spill = re.findall(r"(\d+) bytes spill stores", r.stderr)
sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", str(tmp / "k.cubin")], capture_output=True, text=True).stdout
if a.dump:
    Path(a.dump).write_text(sass)
lines = []
for ln in sass.splitlines():
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
    if m:
        lines.append((int(m.group(1), 16), m.group(2).strip()))
addr = {ad: i for i, (ad, _) in enumerate(lines)}
# The main loop: the backward branch whose range holds the most HMMAs, the shortest of those.
hmma = [i for i, (_, t) in enumerate(lines) if "HMMA" in t]
best = None
for i, (ad, ins_) in enumerate(lines):
    m = re.search(r"BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", ins_)
    if not m or int(m.group(1), 16) >= ad or int(m.group(1), 16) not in addr:
        continue
    j = addr[int(m.group(1), 16)]
    key = (sum(j <= h <= i for h in hmma), -(i - j))
    if best is None or key > best[2]:
        best = (j, i, key)
ops = collections.Counter()
if best:
    for _, ins_ in lines[best[0] : best[1] + 1]:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins_).split()[0].split(".")[0]
        ops[op] += 1
print(f"KB {a.kb} VB {a.vb} D {D} G {G} M {M} nwarp {plan['nwarp']} PL {dict(plan['template'])['PL']} regs {regs} spill {spill} "
      f"total {len(lines)} loop {sum(ops.values())}")
print(" ".join(f"{k}:{v}" for k, v in ops.most_common(16)))
