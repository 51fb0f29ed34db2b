"""A tiny notebook for the workbook's machinery tests (sweeps, comparisons, the report): a `parameters` cell
with declared ranges and a SEED, a figure, numbers (one of them timing) and a claim, in a few seconds."""

from __future__ import annotations

from pathlib import Path

import nbformat

PARAMETERS = ("N = 2  # int in [1, 100]: a count\nX = 0.5  # float in [0, 10]: a value\n"
              "SEED = 0  # int in [0, 1000]: the seed")


def tiny_notebook(path: Path, claim: str = "N < 50", parameters: str = PARAMETERS) -> Path:
    """Write the notebook to `path` (its stem is its name): it records n = N, x_seed = X * (SEED + 1),
    draw = a number from torch's generator seeded by `nb.seed(SEED)`, and the timing `seconds`."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nimport torch\n"
                                  "from lora_lab.notebook import Record"),
        params,
        nbformat.v4.new_code_cell(f"nb = Record.start({path.stem!r}, globals())\nnb.seed(SEED)"),
        nbformat.v4.new_code_cell("fig, ax = plt.subplots(figsize=(2, 1.5))\nax.plot([0, X])\n"
                                  "nb.figure(fig, 'line')"),
        nbformat.v4.new_code_cell("nb.number('n', N)\nnb.number('x_seed', X * (SEED + 1))\n"
                                  "nb.number('draw', torch.rand(()).item())\n"
                                  "nb.number('nested', {'a': [N, 2 * N]})\n"
                                  "nb.number('seconds', 0.1 * SEED, timing=True)\n"
                                  f"nb.claim('the claim', {claim})\nnb.finish()"),
    ]
    nbformat.write(nb, path)
    return path
