# One line per (preset, context) of chained_timing.py results: x SDPA (build + eval) per variant.
import json, sys
for f in sys.argv[1:]:
    print("#", f)
    for r in json.load(open(f)):
        v = {k: r[k]["x_sdpa"] for k in r if isinstance(r[k], dict) and "x_sdpa" in r[k]}
        sd = r["sdpa"]
        print(r["preset"], r["L"], f"sdpa {sd['build']}+{sd['eval']}", " ".join(f"{k} {x} ({r[k]['build']}+{r[k]['eval']})" for k, x in v.items()),
              "maxerr", max(r["errs"].values()))
