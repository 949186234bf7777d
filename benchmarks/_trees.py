"""Another checkout's `turnrouter`, imported beside this one (for A/B benchmarks)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def import_tree(src: str, alias: str) -> types.ModuleType:
    """The `turnrouter` package under `src` (another checkout's `src` directory),
    imported as `alias`, so both trees run in one process. Exits naming `--baseline
    src` when there is no package there."""
    init = Path(src) / "turnrouter" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        alias, init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None or not init.is_file():
        raise SystemExit(f"--baseline {src}: no turnrouter package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module
