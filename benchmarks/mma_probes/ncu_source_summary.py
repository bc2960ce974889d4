import csv, sys, re, collections
rows = list(csv.reader(open(sys.argv[1])))
hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
H = rows[hi]
data = [dict(zip(H, r)) for r in rows[hi + 1:] if len(r) > 5 and r[0].startswith("0x")]
S = "Warp Stall Sampling (All Samples)"
n = lambda d, k: int((d.get(k) or "0").replace(",", "") or 0)
tot = sum(n(d, S) for d in data)
ex = sum(n(d, "Instructions Executed") for d in data)
print("samples", tot, "instructions", len(data), "executed (warp-level)", ex)
stalls = [h for h in H if h.startswith("stall_") and "Not Issued" not in h]
print("by reason:", sorted(((sum(n(d, k) for d in data), k) for k in stalls), reverse=True)[:10])
# hottest straight region: instructions executed the most times (the main loop)
mx_exec = max(n(d, "Instructions Executed") for d in data)
hot = [d for d in data if n(d, "Instructions Executed") >= 0.5 * mx_exec]
op = lambda d: re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", d["Source"]).group(1)
h = collections.Counter()
for d in data:
    h[op(d)] += n(d, "Instructions Executed")
print("loop body (>= half max exec):", len(hot), "static instr, executions per instr ~", mx_exec)
print("all executed by opcode:", [(k, v, round(v / mx_exec, 1)) for k, v in h.most_common(30)])
hs = collections.Counter()
for d in data: hs[op(d)] += n(d, S)
print("stall samples by opcode:", hs.most_common(15))
