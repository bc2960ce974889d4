"""Packed-weight products on MLX's CPU backend: a C++ primitive, built on first use.

A decode step on the CPU is bound by reading the weights: float32 weights are 8x the bytes of
the 4-bit ones a GGUF or an mlx-community checkpoint ships, and MLX's own CPU quantized matmul
reads packed weights slower than MKL reads float32 ones (docs/backends.md). `quantized_matmul`
here reads MLX's packed affine weights (4 and 8 bits, groups of 32, 64 or 128) directly for a
decode step and through BLAS for prefill (`qmv.cpp`), as an MLX primitive inside the graph.

The extension is compiled the first time it is needed, against the installed MLX, with CMake,
a C++ compiler and nanobind (the `cpu` extra installs cmake and nanobind), into
$XDG_CACHE_HOME/turbospark-mlx/cpu-ext/ (default ~/.cache); later processes load the built
module. It runs on x86-64 CPUs with AVX-512 or AVX2 (the widest they have). `status()` says
whether it is in use and, if not, why; TURBOSPARK_CPU_KERNELS=off turns it off. Where it is not
in use, `ts.load` unpacks quantized weights to float32 on the CPU instead (`loading`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from types import ModuleType

import mlx.core as mx

__all__ = ["available", "quantized_matmul", "set_isa", "status", "supports"]

_HERE = Path(__file__).resolve().parent
_SOURCES = ("CMakeLists.txt", "bindings.cpp", "qmv.cpp", "qmv.h", "qmv_isa.h", "qmv_kernels.h",
            "qmv_avx512.cpp", "qmv_avx2.cpp")  # fmt: skip
_MODULE = "_tsx_cpu"
_state: dict[str, object] = {}  # "module": the loaded extension, or "reason": why there is none


def supports(group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether `quantized_matmul` takes weights quantized so."""
    return mode == "affine" and bits in (4, 8) and group_size in (32, 64, 128)


def available() -> bool:
    """Whether the extension is built (building it now if needed) and runs on this CPU."""
    return _extension() is not None


def status() -> str:
    """"in use (<instruction set>, <path>)", or why the packed-weight products are not in use."""
    ext = _extension()
    return f"in use ({ext.isa()}, {ext.__file__})" if ext is not None else str(_state["reason"])


def set_isa(name: str) -> None:
    """Run the kernels of one instruction set, "avx512" or "avx2" (to compare them, or to test
    the narrower one on a CPU that has both), or the widest this CPU has ("auto", the default).
    Raises ValueError for one this CPU lacks, RuntimeError where `available()` is False."""
    ext = _extension()
    if ext is None:
        raise RuntimeError(f"turbospark_mlx CPU kernels: {_state['reason']}")
    ext.set_isa(name)


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """x @ mx.dequantize(w, scales, biases, group_size, bits).T on the CPU, in x's dtype.

    w is MLX's packed (N, K * bits / 32) uint32 weight, scales and biases float32 (N, K /
    group_size), all row-contiguous. Raises RuntimeError where `available()` is False.
    """
    ext = _extension()
    if ext is None:
        raise RuntimeError(f"turbospark_mlx CPU kernels: {_state['reason']}")
    y = ext.quantized_matmul(x, w, scales, biases, group_size, bits, stream=_cpu_stream())
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _cpu_stream() -> mx.Stream | mx.Device:
    """The current stream where the default device is the CPU (a thread-local stream, such as
    the server's engine thread runs on, included), else the CPU's default stream."""
    return mx.default_stream(mx.cpu) if mx.default_device() == mx.cpu else mx.cpu


def _extension() -> ModuleType | None:
    if "module" in _state or "reason" in _state:
        return _state.get("module")  # type: ignore[return-value]
    reason = _unsupported_here()
    if reason is None:
        try:
            module = _load_or_build()
            reason = _check(module)
        except _BuildError as e:
            reason = str(e)
            warnings.warn(
                f"turbospark_mlx: the CPU kernels for packed weights did not build ({e}); quantized "
                "weights are unpacked to float32 instead (slower decode). TURBOSPARK_CPU_KERNELS=off "
                "silences this.",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            if reason is None:
                _state["module"] = module
                return module
    _state["reason"] = reason
    return None


def _unsupported_here() -> str | None:
    if os.environ.get("TURBOSPARK_CPU_KERNELS", "").lower() in ("off", "0", "false", "no"):
        return "off (TURBOSPARK_CPU_KERNELS)"
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"not built for {sys.platform} {platform.machine()} (Linux x86-64 only)"
    cpu = Path("/proc/cpuinfo")
    flags = cpu.read_text(errors="replace") if cpu.exists() else ""
    if " avx2" not in flags or " fma" not in flags:
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    return None


class _BuildError(RuntimeError):
    pass


def _build_key() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_HERE / name).read_bytes())
    for dist in ("mlx", "nanobind"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            raise _BuildError(f"the {dist} package is not installed (pip install 'turbospark-mlx[cpu]')")
    h.update(f"{sys.implementation.cache_tag} {platform.machine()}".encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "turbospark-mlx" / "cpu-ext"


def _load_or_build() -> ModuleType:
    """The built module from the cache, building it first (under a file lock) if missing."""
    root = _cache_root()
    target = root / _build_key()
    built = sorted(target.glob(f"{_MODULE}*.so")) if target.is_dir() else []
    if not built:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
            built = sorted(target.glob(f"{_MODULE}*.so")) if target.is_dir() else []
            if not built:
                _build(root, target)
                built = sorted(target.glob(f"{_MODULE}*.so"))
    spec = importlib.util.spec_from_file_location(_MODULE, built[0])
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise _BuildError(f"{built[0]} does not load: {e}") from None
    return module


def _build(root: Path, target: Path) -> None:
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's first
    cmake = shutil.which("cmake", path=search)
    if cmake is None:
        raise _BuildError("cmake was not found (pip install cmake)")
    print(f"turbospark_mlx: building the CPU kernels for packed weights in {target} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        log = Path(tmp) / "build.log"
        steps = [
            [cmake, "-S", str(_HERE), "-B", f"{tmp}/build", "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython_EXECUTABLE={sys.executable}"],
            [cmake, "--build", f"{tmp}/build", "-j", str(os.cpu_count() or 1)],
        ]  # fmt: skip
        for cmd in steps:
            with open(log, "a") as out:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                kept = root / "build-failed.log"
                shutil.copyfile(log, kept)
                tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                raise _BuildError(f"{' '.join(cmd[:2])} failed: {tail[0] if tail else ''} (log: {kept})")
        staged = Path(tmp) / "out"
        staged.mkdir()
        for so in Path(tmp, "build").glob(f"{_MODULE}*.so"):
            shutil.copy2(so, staged / so.name)
        os.replace(staged, target)  # whole or not at all: a reader never sees half a build


def _check(module: ModuleType) -> str | None:
    """None if the module runs here and matches `mx.dequantize` + matmul; else why not."""
    if not module.cpu_supported():
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    key, cpu = mx.random.key(0), _cpu_stream()
    weight = mx.random.normal((48, 256), key=key, stream=cpu)
    for bits, group_size in ((4, 32), (8, 64)):
        w, s, b = mx.quantize(weight, group_size=group_size, bits=bits, stream=cpu)
        dense = mx.dequantize(w, s, b, group_size=group_size, bits=bits, stream=cpu)
        for rows in (1, 8, 9):
            x = mx.random.normal((rows, 256), key=mx.random.split(key)[rows % 2], stream=cpu)
            try:
                got = module.quantized_matmul(x, w, s, b, group_size, bits, stream=cpu)
            except TypeError as e:  # MLX and the module disagree on nanobind's ABI
                return f"the built module does not take MLX arrays ({e}); nanobind and MLX disagree"
            want = mx.matmul(x, dense.T, stream=cpu)
            if not mx.allclose(got, want, rtol=1e-4, atol=1e-4).item():
                return f"the built module's {bits}-bit product differs from mx.dequantize + matmul"
    return None
