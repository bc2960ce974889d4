"""MLX's CPU backend on MKL (turbospark_mlx/cpu_blas.py) where the `cpu` extra installs it."""

import json
import platform
import subprocess
import sys
from importlib import metadata

import mlx.core as mx
import numpy as np
import pytest

import turbospark_mlx as ts

try:
    metadata.version("mkl")
    HAS_MKL = True
except metadata.PackageNotFoundError:
    HAS_MKL = False

PROBE = """
import json, time
import turbospark_mlx as ts
import mlx.core as mx
a = mx.random.normal((256, 512), key=mx.random.key(0)); b = mx.random.normal((512, 384), key=mx.random.key(1))
c = a @ b
mx.eval(c)
print(json.dumps({"blas": ts.cpu_blas(), "c": c.tolist()}))
"""


def _probe(**env) -> dict:
    import os

    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not (HAS_MKL and sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="MKL comes with the cpu extra on Linux x86-64 only")
def test_mkl_runs_mlx_cpu_matmuls():
    """Importing the package puts MKL under MLX's CPU matmuls; TURBOSPARK_CPU_BLAS=reference
    leaves MLX's own BLAS; both give the same product (to float32 rounding)."""
    fast, ref = _probe(TURBOSPARK_CPU_BLAS=""), _probe(TURBOSPARK_CPU_BLAS="reference")
    assert "libmkl_rt" in fast["blas"] and ref["blas"] == "reference"
    a, b = np.asarray(fast["c"]), np.asarray(ref["c"])
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_imported_after_mlx_it_says_it_cannot():
    """mlx.core bound its BLAS when it was imported: the package warns instead of claiming MKL."""
    import os

    probe = "import mlx.core, warnings\nwarnings.simplefilter('error')\nimport turbospark_mlx"
    env = dict(os.environ, TURBOSPARK_CPU_BLAS="")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if HAS_MKL and sys.platform.startswith("linux") and platform.machine() == "x86_64":
        assert out.returncode != 0 and "import turbospark_mlx first" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
