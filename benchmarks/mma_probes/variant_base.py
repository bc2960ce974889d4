"""The kernel the loop-variant probes (pipelined_variant.py, s11_variants.py) rewrite: session
10's tq_decode_mma.kernel (commit 691ab4a), whose single main loop they take apart. The current
kernel runs the loop in rounds (session 11), so their anchors are no longer in it.
"""
import subprocess
from pathlib import Path

BASE_COMMIT = "691ab4a"
ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / ".h200-mlx" / "scratch"


def base_source() -> str:
    """The base kernel's text, kept in the scratch folder (carried to the GPU machine, which has
    no git history)."""
    path = SCRATCH / f"tq_decode_mma_{BASE_COMMIT}.kernel"
    if not path.exists():
        text = subprocess.run(["git", "show", f"{BASE_COMMIT}:kernels/tq_decode_mma.kernel"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        SCRATCH.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path.read_text()


def main_loop(src: str) -> tuple[int, int, str]:
    """(start, end, text) of the main loop: from its slot counters to the merge's wait."""
    a = src.index("int slot = 0, fill = STAGES - 1;")
    b = src.index("ts_cp_wait<0>();  // the merge below reuses the ring")
    return a, b, src[a:b]
