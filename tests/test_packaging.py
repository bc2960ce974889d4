"""The built wheel carries kernels/ inside the package, readable after install."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from turbospark_mlx.gpu.sources import kernel_source, kernels_dir

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_sources_readable_from_checkout():
    assert "ts_simd_sum" in kernel_source("prelude_cuda.h")
    assert "metal_stdlib" in kernel_source("prelude_metal.h")
    with pytest.raises(FileNotFoundError, match="available"):
        kernel_source("nope.metal")
    assert (kernels_dir() / "prelude_cuda.h").is_file()


@pytest.mark.slow
def test_wheel_ships_kernels(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("turbospark_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {Path(n).name for n in names if n.startswith("turbospark_mlx/kernels/")}
    assert {p.name for p in (ROOT / "kernels").iterdir()} <= kernels
    # the CPU kernels' C++ sources and CMake file, built on first use after install
    cpu = {Path(n).name for n in names if n.startswith("turbospark_mlx/cpu_ext/")}
    here = ROOT / "turbospark_mlx" / "cpu_ext"
    sources = {p.name for p in here.iterdir() if p.suffix in (".cpp", ".h", ".txt")}
    assert {"CMakeLists.txt", "qmv.cpp", "qmv_avx2.cpp", "qmv_kernels.h"} <= sources <= cpu, cpu
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel lacks LICENSE"
    # Install it on its own and read a kernel source through the installed package.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True
    )
    code = (
        "import turbospark_mlx, turbospark_mlx.gpu.sources as k; "
        "print(turbospark_mlx.__file__); print(k.kernels_dir()); print(len(k.kernel_source('prelude_cuda.h')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    pkg_file, kdir, n = out.stdout.split()
    assert pkg_file.startswith(str(target)) and kdir.startswith(str(target)) and int(n) > 0


@pytest.mark.slow
def test_sdist_carries_the_package_not_the_benchmarks(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "-o", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("turbospark_mlx-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tops = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 1}
    assert {"turbospark_mlx", "kernels", "tests", "examples", "README.md", "LICENSE"} <= tops
    assert "benchmarks" not in tops
