"""Imported before torch by the scripts that run PyTorch: where PyTorch is
not installed, the script says so and how to install it, instead of
failing with a traceback."""

import pathlib
import sys

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    sys.exit(
        f"error: {pathlib.Path(sys.argv[0]).name} runs PyTorch, which this Python "
        f"({sys.executable}) cannot import ({e}): install it with `pip install torch`, "
        "or run the script with a Python that has it"
    )
