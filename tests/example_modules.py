"""The examples' scripts as modules, each under its own name: two examples both call their script
`train.py`, and a plain `from train import ...` after a sys.path insert returns whichever one an
earlier test on the same worker imported first."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_module(example: str, script: str = "train") -> ModuleType:
    """examples/EXAMPLE/SCRIPT.py, imported once as `example_EXAMPLE_SCRIPT`."""
    name = f"example_{example}_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / example / f"{script}.py")
        assert spec is not None and spec.loader is not None, f"no script {example}/{script}.py"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
