"""Model families. One file per HF `model_type`, read top to bottom like mlx-lm's.

Adding a family is one file here (with `ModelArgs` and `Model`) plus, for an
alias of an existing family, one line in `MODEL_REMAPPING`.
"""

from __future__ import annotations

import importlib
import pkgutil

# HF model_type -> the family file that implements it.
MODEL_REMAPPING = {
    "mistral": "llama",
}

_NOT_FAMILIES = {"base"}


def supported_model_types() -> list[str]:
    """Every model_type `get_model_classes` accepts: the family files present plus their aliases."""
    files = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")} - _NOT_FAMILIES
    return sorted(files | {alias for alias, target in MODEL_REMAPPING.items() if target in files})


def get_model_classes(model_type: str):
    """(Model, ModelArgs) of the family implementing HF `model_type`.

    Raises:
        ValueError: the model_type has no family file here; the message lists the supported ones.
    """
    name = MODEL_REMAPPING.get(model_type, model_type)
    if not isinstance(name, str) or name not in supported_model_types():
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    module = importlib.import_module(f"{__name__}.{name}")
    return module.Model, module.ModelArgs
