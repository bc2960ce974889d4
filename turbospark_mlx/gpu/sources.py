"""Kernel sources: read from the package (wheel) or the repository's kernels/.

The wheel maps the top-level `kernels/` folder to `turbospark_mlx/kernels`
(pyproject.toml, force-include); in a source checkout the folder sits beside
the package. Kernel objects are built elsewhere, once per template, and kept
out of cache instances (caches are deep-copied).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path


def kernels_dir() -> Path:
    """The folder holding kernel sources for this installation."""
    packaged = resources.files("turbospark_mlx") / "kernels"
    if packaged.is_dir():
        return Path(str(packaged))
    source_tree = Path(__file__).resolve().parents[2] / "kernels"
    if source_tree.is_dir():
        return source_tree
    raise FileNotFoundError(
        "turbospark_mlx kernel sources not found: the package is installed without its kernels/ folder"
    )


@lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of kernel source `name` (e.g. "prelude_cuda.h")."""
    path = kernels_dir() / name
    if not path.is_file():
        available = sorted(p.name for p in kernels_dir().iterdir())
        raise FileNotFoundError(f"no kernel source {name!r}; available: {', '.join(available)}")
    return path.read_text()
