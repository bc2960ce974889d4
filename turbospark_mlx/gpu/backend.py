"""Which implementation runs the TurboQuant hot paths: metal, cuda or reference.

Automatic from the MLX build and the default device: Metal kernels when MLX has
Metal and the default device is the GPU, CUDA kernels likewise, else the
plain-`mx` reference (CPU, CI). Overridable: `set_backend(name)`,
`with use_backend(name): ...`, or the TURBOSPARK_BACKEND environment variable.

When a kernel cannot serve a configuration the caller is told why: with a
backend chosen explicitly that is an error; with the automatic choice the
reference runs and a warning names the reason (once per reason).
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

import mlx.core as mx

BACKENDS = ("metal", "cuda", "reference")
ENV_VAR = "TURBOSPARK_BACKEND"

_override: str | None = None
_warned: set[str] = set()


class KernelUnsupported(ValueError):
    """An explicitly chosen kernel backend cannot serve this configuration."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


@lru_cache(maxsize=None)
def _gpu_backend() -> str | None:
    """The GPU backend this MLX build has, if any (fixed for the process; asked once, since a
    decode step asks for the backend in every layer)."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def auto_backend() -> str:
    """The backend the MLX build and default device call for."""
    if mx.default_device() == mx.gpu:
        return _gpu_backend() or "reference"
    return "reference"


def requested_backend() -> str | None:
    """The explicitly chosen backend (set_backend / use_backend / TURBOSPARK_BACKEND), if any."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    return _check_name(env) if env else None


def current_backend() -> str:
    """The backend in force now."""
    name = requested_backend()
    if name is None:
        return auto_backend()
    if name == "metal" and not mx.metal.is_available():
        raise RuntimeError("backend 'metal' was requested but this MLX build has no Metal backend")
    if name == "cuda" and not mx.cuda.is_available():
        raise RuntimeError("backend 'cuda' was requested but this MLX build has no CUDA backend")
    return name


def set_backend(name: str | None) -> None:
    """Force a backend for this process (None: back to automatic)."""
    global _override
    _override = None if name is None else _check_name(name)


@contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run a block with a backend forced (None: automatic)."""
    global _override
    old = _override
    set_backend(name)
    try:
        yield
    finally:
        _override = old


def resolve(reason: str | None) -> str:
    """The backend to run a kernel op on, given why the kernel cannot serve it (None: it can).

    Explicit choice + reason -> KernelUnsupported; automatic choice + reason -> a
    warning naming the reason and the reference backend.
    """
    name = current_backend()
    if name == "reference" or reason is None:
        return name
    if requested_backend() is not None:
        raise KernelUnsupported(f"{name} kernels cannot serve this: {reason}")
    message = f"turbospark_mlx: {name} kernels cannot serve this, using the reference backend: {reason}"
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return "reference"
