"""The quick-start notebook runs top to bottom (micro settings) and is committed without outputs."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "colabs" / "quickstart.ipynb"


def test_notebook_is_committed_without_outputs():
    """No cell of the committed notebook carries outputs or execution counts."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    """Every cell runs without error on the micro config and the accuracy line is printed."""
    monkeypatch.setenv("TLTJAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("TLTJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parents[1])}}).execute()
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "stream"
    )
    assert "greedy accuracy on 32 held-out problems" in text
