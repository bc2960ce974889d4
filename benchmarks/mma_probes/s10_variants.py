"""The kernel variants session 10's probes compared, written from the current kernel file into
.h200-mlx/scratch/ (carried to the GPU machine, ignored by git): nov2 (V2 off), noskip (the
max reduction on every tile), sc4 (four score accumulators). run_s10a.sh also needs session 9's
tree there: `git archive 53ea015 | tar -x -C .h200-mlx/scratch/head`."""
import re
from pathlib import Path

root = Path(__file__).resolve().parents[2]
src = (root / "kernels" / "tq_decode_mma.kernel").read_text()
out = root / ".h200-mlx" / "scratch"
out.mkdir(parents=True, exist_ok=True)


def swap(text: str, old: str, new: str) -> str:
    assert old in text, old[:60]
    return text.replace(old, new, 1)


(out / "nov2.kernel").write_text(swap(src, "constexpr bool V2 = PL && VB == 4;", "constexpr bool V2 = false;"))
skip = re.search(r"    if \(__any_sync\(0xffffffffu, tmax\[0\] > mrow.*?\n    }\n", src, re.S).group(0)
body = skip[skip.index("\n") + 1 : skip.rindex("    }\n")]
(out / "noskip.kernel").write_text(src.replace(skip, body, 1))
sc4 = swap(src, "float sc[RN][4], sc2[RN][4];", "float sc[RN][4], scx[3][RN][4];")
sc4 = swap(sc4, "sc[n][e] = sc2[n][e] = 0.0f;", "sc[n][e] = scx[0][n][e] = scx[1][n][e] = scx[2][n][e] = 0.0f;")
sc4 = swap(sc4, "ts_mma16816((s & 1) ? sc2[n] : sc[n],", "ts_mma16816((s % 4) ? scx[s % 4 - 1][n] : sc[n],")
sc4 = swap(sc4, "sc[n][e] += sc2[n][e];", "sc[n][e] += (scx[0][n][e] + scx[1][n][e]) + scx[2][n][e];")
(out / "sc4.kernel").write_text(sc4)
print("wrote", *(p.name for p in sorted(out.glob("*.kernel"))))
