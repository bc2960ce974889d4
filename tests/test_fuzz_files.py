"""Damaged files never crash the process: >= 200 mutated GGUF and safetensors model files and
>= 50 mutated cache files (flipped header bytes, truncations, huge counts and lengths), all
loaded in one child process, so a crash (a signal) fails the test instead of killing pytest.
Each load either succeeds (a mutation that leaves the file valid, e.g. a byte of a float
weight) or raises the package's ValueError naming the file; a damaged cache never loads."""

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import pytest
from test_loading import CONFIG, random_model, write_gguf, write_hf_dir

from turbospark_mlx import KVCacheManager, LayerSpec, store_kv

CHILD = r"""
import json, sys
import turbospark_mlx as ts
from turbospark_mlx import KVCacheManager
out = []
for kind, path in json.loads(open(sys.argv[1]).read()):
    try:
        ts.load(path) if kind == "model" else KVCacheManager.from_file(path)
        out.append([path, "loaded", ""])
    except (ValueError, FileNotFoundError) as e:
        out.append([path, "refused", str(e)])
    except Exception as e:  # any other type is a defect the test reports
        out.append([path, "other", f"{type(e).__name__}: {e}"])
print(json.dumps(out))
"""


def _mutants(data: bytes, header_end: int, rng: random.Random, n_flip: int, n_cut: int) -> list[bytes]:
    out = []
    for _ in range(n_flip):  # 1-4 random bytes of the header / table
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(header_end)] = rng.randrange(256)
        out.append(bytes(d))
    for _ in range(n_cut):
        out.append(data[: rng.randrange(len(data))])
    return out


@pytest.mark.slow
def test_damaged_model_and_cache_files_are_refused_by_name(tmp_path):
    rng = random.Random(0)
    model = random_model()
    files: list[tuple[str, str]] = []

    def add(kind: str, name: str, blob: bytes, suffix: str) -> None:
        p = tmp_path / f"{name}{suffix}"
        p.write_bytes(blob)
        files.append((kind, str(p)))

    # GGUF: the header and tensor table end where the first tensor's data starts.
    g = write_gguf(tmp_path / "m.gguf", model, CONFIG, "llama", gguf.GGMLQuantizationType.Q8_0)
    data = g.read_bytes()
    table_end = min(int(t.data_offset) for t in gguf.GGUFReader(str(g)).tensors)
    for i, blob in enumerate(_mutants(data, table_end, rng, 90, 40)):
        add("model", f"g{i}", blob, ".gguf")
    for i, (at, value) in enumerate([(8, 2**40), (16, 2**40), (8, 2**63 - 1), (16, 2**63 - 1), (8, 0), (16, 0)]):
        add("model", f"gcount{i}", data[:at] + struct.pack("<Q", value) + data[at + 8 :], ".gguf")
    for i in range(14):  # a huge 8-byte length or offset at a random 8-aligned place of the table
        at = rng.randrange(24, table_end - 8) // 8 * 8
        add("model", f"glen{i}", data[:at] + struct.pack("<Q", rng.choice([2**31, 2**40, 2**62])) + data[at + 8 :], ".gguf")

    # safetensors, in HF directories: header length, JSON table, data.
    hf = write_hf_dir(tmp_path / "hf", model)
    st = next(hf.glob("*.safetensors"))
    sdata = st.read_bytes()
    n = int.from_bytes(sdata[:8], "little")
    for i, blob in enumerate(_mutants(sdata, 8 + n, rng, 40, 20) + [struct.pack("<Q", 2**40) + sdata[8:]]):
        d = tmp_path / f"hf{i}"
        d.mkdir()
        for f in hf.iterdir():
            (d / f.name).write_bytes(blob if f.name == st.name else f.read_bytes())
        files.append(("model", str(d)))

    # Cache files: digest-checked, so no mutation may load.
    cache = KVCacheManager([LayerSpec(2, 64)], "tq4", max_rows=160)
    store_kv(cache, 0, 0, mx.random.normal((1, 2, 150, 64)), mx.random.normal((1, 2, 150, 64)))
    cdata = Path(cache.save(str(tmp_path / "c.safetensors"))).read_bytes()
    for i in range(60):
        d = bytearray(cdata)
        if i % 3:
            d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)  # one flipped bit anywhere
        else:
            d = d[: rng.randrange(len(d))]
        add("cache", f"c{i}", bytes(d), ".safetensors")

    assert sum(k == "model" for k, _ in files) >= 200 and sum(k == "cache" for k, _ in files) >= 50
    listing = tmp_path / "files.json"
    listing.write_text(json.dumps(files))
    run = subprocess.run([sys.executable, "-c", CHILD, str(listing)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the loader process died: rc {run.returncode}\n{run.stderr[-3000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    kinds = dict(files)
    other = [r for r in results if r[1] == "other"]
    assert not other, other[:5]
    unnamed = [r for r in results if r[1] == "refused" and Path(r[0]).name not in r[2]]
    assert not unnamed, unnamed[:5]
    loaded_caches = [r for r in results if r[1] == "loaded" and kinds[r[0]] == "cache"]
    assert not loaded_caches, loaded_caches[:5]
    refused = sum(r[1] == "refused" for r in results)
    print(f"{len(results)} files: {refused} refused by name, {len(results) - refused} still valid and loaded")
