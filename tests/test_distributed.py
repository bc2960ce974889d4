"""Tensor and pipeline parallelism on 2 local ranks: `mlx.launch -n 2 --backend ring`, CPU.

One launch runs every case of tests/distributed_worker.py (tensor parallel and pipeline for
the package's families, the drop-in cache on a sharded mlx-lm model; fp16, tq4 and k8v4).
This process runs the same seeded models in one process and compares, per case: the greedy
tokens and the logits they were picked from; each rank's KV bytes (1/N of the single
process's under tensor parallelism, its own layers' under pipeline); and the storage itself:
layer 0 of a tensor-parallel rank is the single process's slice of its heads bit for bit
(codes, norms, FP16 window, key mean: the rank's heads use the rotations and codebooks of the
single process), and a pipeline stage's layers are the single process's bit for bit. A
second launch, in which rank 1 fails mid-generation, must end with an error inside a timeout.

The checks that need no second rank (heads that do not divide, a stage's cache, families
that cannot shard) run in this process with a stand-in group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import distributed_worker as worker
import turbospark_mlx as ts
from families import CONFIGS as FAMILY_CONFIGS
from test_loading import CONFIG as LOADING_CONFIG
from test_loading import WORDS, random_model, write_hf_dir
from turbospark_mlx.models import get_model_classes

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
N = 2
TIMEOUT_S = 240  # the whole launch; measured ~15 s on 2 cores
FAIL_TIMEOUT_S = 60


def _launcher() -> str | None:
    here = Path(sys.executable).parent / "mlx.launch"
    return str(here) if here.is_file() else shutil.which("mlx.launch")


LAUNCH = _launcher()
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed (it comes with mlx)")


def _free_port_pair() -> int:
    """A port p with p and p + 1 free: the ring backend listens on one port per rank."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def launch(out_dir: Path, *args: str, timeout: float) -> tuple[str, float]:
    """Run the worker on N ranks; returns (its stdout + stderr, seconds)."""
    out, err, seconds = launch_command([str(WORKER), str(out_dir), *args], timeout=timeout)
    return out + err, seconds


def launch_command(command: list[str], timeout: float) -> tuple[str, str, float]:
    """`mlx.launch` a Python command line on N ranks; returns (stdout, stderr, seconds). A launch
    still running after `timeout` seconds is killed (the launcher and its ranks) and fails the test."""
    env = dict(os.environ, TURBOSPARK_CPU_BLAS="reference", OMP_NUM_THREADS="1")
    # The ranks import the package from this checkout, as this process does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cmd = [LAUNCH, "-n", str(N), "--backend", "ring", "--starting-port", str(_free_port_pair())]
    cmd += ["--python", sys.executable, "--", *command]
    tic = time.monotonic()
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the {N}-rank launch still ran after {timeout} s (a hang); output:\n{(out + err)[-4000:]}")
    return out, err, time.monotonic() - tic


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results (the json it wrote, plus its arrays by case)."""
    out_dir = tmp_path_factory.mktemp("ranks")
    out, _ = launch(out_dir, timeout=TIMEOUT_S)
    results = []
    for r in range(N):
        path = out_dir / f"rank{r}.json"
        # mlx.launch exits 0 even when a rank fails: each rank's result file is the evidence.
        assert path.is_file(), f"rank {r} wrote no results; launch output:\n{out[-4000:]}"
        res = json.loads(path.read_text())
        assert res["size"] == N
        res["arrays"] = {
            worker.case_name(*c): dict(np.load(out_dir / f"rank{r}_{worker.case_name(*c)}.npz"))
            for c in worker.CASES
        }
        results.append(res)
    return results


def single_process(mode: str, family: str, kv: str) -> tuple[dict, dict]:
    """The case run unsharded in this process: (results, arrays) as a rank reports them."""
    mlx_lm = mode == "mlx_lm"
    tokens, logits, cache = worker.greedy(worker.build(family, mlx_lm=mlx_lm), kv, mlx_lm=mlx_lm)
    nbytes = sum(c.nbytes for c in cache) if mlx_lm else cache.nbytes
    arrays = worker.layer_arrays(cache, mlx_lm)
    arrays["logits"] = np.array(logits)
    layers = {str(i): n for i, n in worker.layer_bytes(cache, mlx_lm).items()}
    return {"tokens": tokens, "nbytes": nbytes, "layer_nbytes": layers}, arrays


@needs_launch
@pytest.mark.parametrize("case", worker.CASES, ids=[worker.case_name(*c) for c in worker.CASES])
def test_ranks_match_single_process(ranks, case):
    mode, family, kv = case
    name = worker.case_name(*case)
    want, want_arrays = single_process(*case)
    for r, res in enumerate(ranks):
        got, arrays = res[name], res["arrays"][name]
        assert got["tokens"] == want["tokens"], (r, got["tokens"], want["tokens"])
        # Tensor parallel sums partial projections in another order: float32 rounding apart.
        scale = np.abs(want_arrays["logits"]).max()
        np.testing.assert_allclose(arrays["logits"], want_arrays["logits"], rtol=0, atol=2e-3 * scale)
        if mode == "pp":
            continue
        assert got["nbytes"] * N == want["nbytes"], (r, got["nbytes"], want["nbytes"])
        assert {k: v * N for k, v in got["layer_nbytes"].items()} == want["layer_nbytes"]
        # Layer 0 sees the same input on every rank: its storage is the single process's heads
        # [r * H/N, (r + 1) * H/N) exactly, so the shard used the same rotation and codebook.
        layer0 = [k for k in want_arrays if k.startswith("0.")]
        assert layer0
        for k in layer0:
            h = arrays[k].shape[1]
            assert want_arrays[k].shape[1] == N * h, k
            assert np.array_equal(arrays[k], want_arrays[k][:, r * h : (r + 1) * h]), (r, k)
    if mode == "pp":
        # Every layer on exactly one rank, each rank's cache holding its layers only.
        held = [set(res[name]["layer_nbytes"]) for res in ranks]
        assert set.union(*held) == set(want["layer_nbytes"])
        assert sum(map(len, held)) == len(want["layer_nbytes"])
        assert all(held), held
        for res, layers in zip(ranks, held):
            assert res[name]["nbytes"] == sum(want["layer_nbytes"][i] for i in layers)
            for k, a in res["arrays"][name].items():
                if k != "logits":
                    assert k.split(".")[0] in layers, k
                    assert np.array_equal(a, want_arrays[k]), k


@needs_launch
def test_failing_rank_ends_the_launch_with_an_error(tmp_path):
    out, seconds = launch(tmp_path, "fail", timeout=FAIL_TIMEOUT_S)
    assert "rank 1 fails on purpose" in out, out[-4000:]
    # Rank 0 waits in a collective: it ends with the ring's error, or the launcher stops it.
    assert "connection to a peer was lost" in out or "Node with rank 0" in out, out[-4000:]
    assert not list(tmp_path.glob("rank*.json")), out[-4000:]
    assert seconds < FAIL_TIMEOUT_S


CLI_CONFIG = dict(LOADING_CONFIG, num_hidden_layers=3, max_position_embeddings=512)


@needs_launch
@pytest.mark.parametrize("flags", [[], ["--pipeline"]], ids=["tensor", "pipeline"])
def test_cli_generate_under_mlx_launch(tmp_path, capsys, flags):
    """`mlx.launch ... -m turbospark_mlx generate` on an HF directory: rank 0 prints the text one
    process prints, every rank its stats line with its own KV bytes (half of one process's)."""
    from turbospark_mlx import cli

    model_dir = write_hf_dir(tmp_path / "model", random_model(CLI_CONFIG), config=CLI_CONFIG)
    words = np.random.default_rng(5).integers(3, len(WORDS), size=150)
    args = ["generate", "--model", str(model_dir), "-p", " ".join(WORDS[w] for w in words)]
    args += ["-m", "8", "--kv", "tq4", "--ignore-chat-template"]
    assert cli.main(args) == 0
    want_out, want_err = capsys.readouterr()
    out, err, _ = launch_command(["-m", "turbospark_mlx", *args, *flags], timeout=TIMEOUT_S)
    assert out.strip() == want_out.strip() and out.strip(), (out, err[-4000:])
    want_kv = re.search(r"KV cache \(tq4\): .*, ([0-9.]+) MiB allocated", want_err)
    stats = re.findall(r"\[rank (\d)/2\] .*KV cache \(tq4\): .*, ([0-9.]+) MiB allocated", err)
    assert sorted(r for r, _ in stats) == ["0", "1"], err[-4000:]
    # 3 layers on 2 ranks: a pipeline stage holds 2 or 1 of them; tensor parallel half of each
    # (the line prints MiB to 2 decimals; the exact bytes are test_ranks_match_single_process's).
    got = sorted(float(kv) for _, kv in stats)
    want = sorted(f * float(want_kv.group(1)) for f in ([1 / 3, 2 / 3] if flags else [1 / 2, 1 / 2]))
    assert got == pytest.approx(want, abs=0.011), (got, want, err[-4000:])


def test_pipeline_flag_needs_mlx_launch(capsys):
    from turbospark_mlx import cli

    assert cli.main(["generate", "--model", "unused", "-p", "w1", "--pipeline"]) == 2
    assert "--pipeline splits the model over several ranks: run under mlx.launch" in capsys.readouterr().err


# -- in this process ---------------------------------------------------------


class StandInGroup:
    """An N-rank group as far as `shard`'s checks and `pipeline`'s split read it (size, rank);
    nothing here runs a collective."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(
    "family, size, named",
    [
        ("llama", 3, "num_attention_heads=4, num_key_value_heads=2"),
        ("qwen3", 4, "num_key_value_heads=2"),
        ("gemma3_text", 4, "num_key_value_heads=2"),
    ],
)
def test_shard_names_the_sizes_that_do_not_divide(family, size, named):
    model = worker.build(family)
    before = model.kv_layer_specs()
    with pytest.raises(ValueError, match=f"{family}: cannot shard over {size} ranks: {named} not divisible"):
        model.shard(StandInGroup(size))
    assert model.kv_layer_specs() == before  # the refused shard split nothing


@pytest.mark.parametrize("family", ["gemma4_text", "muse_glimmer"])
def test_families_without_parallelism_say_so(family):
    Model, Args = get_model_classes(FAMILY_CONFIGS[family]["model_type"])
    model = Model(Args.from_dict(FAMILY_CONFIGS[family]))
    for split in (lambda: model.shard(StandInGroup(2)), lambda: model.pipeline(StandInGroup(2))):
        with pytest.raises(ValueError, match=f"{family}: tensor and pipeline parallelism are not implemented"):
            split()


def test_pipeline_stage_cache_holds_its_layers_only(tmp_path):
    """Of 3 layers on 2 ranks, rank 0 keeps the last 2 (a low rank gets the extra one) and rank 1
    the first; a stage's cache holds, saves and loads only its layers."""
    model = worker.build("llama")
    model.pipeline(StandInGroup(2, rank=0))
    assert [l is None for l in model.layers] == [True, False, False]
    cache = ts.make_cache(model, kv="tq4")
    assert cache.held_layers == [1, 2] and cache.n_layers == 3
    with pytest.raises(ValueError, match="layer 0 is held by another pipeline stage"):
        cache.layer_offset(0)
    k = mx.random.normal((1, 2, 5, 16)).astype(mx.float16)
    with pytest.raises(ValueError, match="layer 0 is held by another pipeline stage"):
        ts.store_kv(cache, 0, 0, k, k)
    for i in (1, 2):
        ts.store_kv(cache, i, 0, k, k)
    assert cache.offset == 5
    # The stage's layers are compressed as in the whole model: same tables per layer index.
    whole = ts.make_cache(worker.build("llama"), kv="tq4")
    for i in (1, 2):
        assert cache.layer_quant(i).k.fingerprint() == whole.layer_quant(i).k.fingerprint()
    assert cache.layer_quant(1).k.fingerprint() != cache.layer_quant(2).k.fingerprint()
    loaded = ts.KVCacheManager.from_file(cache.save(str(tmp_path / "stage.safetensors")))
    assert loaded.held_layers == [1, 2] and loaded.offset == 5 and loaded.nbytes == cache.nbytes

    other = worker.build("llama")
    other.pipeline(StandInGroup(2, rank=1))
    assert ts.make_cache(other, kv="tq4").held_layers == [0]


def test_pipeline_split_errors():
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 pipeline stages"):
        worker.build("llama").pipeline(StandInGroup(4))
    with pytest.raises(ValueError, match=r"split \[3, 0\] must give each of 2 ranks"):
        worker.build("llama").pipeline(StandInGroup(2), split=[3, 0])
    model = worker.build("llama")
    model.pipeline(StandInGroup(2), split=[1, 2])  # rank 0: 1 layer, the last
    assert [l is None for l in model.layers] == [True, True, False]
    with pytest.raises(ValueError, match="already split"):
        model.pipeline(StandInGroup(2))


def test_load_pipeline_stage_reads_only_its_layers(tmp_path):
    """ts.load(group=, pipeline=True) splits before evaluating: the other stages' tensors are
    never read, so a stage of 2 of 8 layers peaks far below the whole model."""
    config = dict(LOADING_CONFIG, hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    path = write_hf_dir(tmp_path / "model", random_model(config), config=config)

    def peak(**kwargs) -> int:
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        model, _ = ts.load(str(path), **kwargs)
        used = mx.get_peak_memory() - base
        assert sum(l is not None for l in model.layers) == (2 if kwargs else 8)
        return used

    whole = peak()
    stage = peak(group=StandInGroup(4, rank=1), pipeline=True)
    # 2 of 8 layers plus the embeddings and head (here about 1/8 of the weights).
    assert stage < 0.4 * whole, (stage, whole)
    with pytest.raises(ValueError, match="pipeline=True needs a group"):
        ts.load(str(path), pipeline=True)
