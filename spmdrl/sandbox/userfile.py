"""Import a user's Python file (a reward function, a tool class) under a private module name.

    module = import_file(Path("my_reward.py"), "reward", "reward.function='my_reward.py:score'")
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(file: Path, kind: str, where: str) -> ModuleType:
    """Import the user's Python ``file`` under a private module name; ``kind`` and ``where`` name it in
    errors.

    Raises FileNotFoundError for a missing file and ImportError for one that does not import.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{kind} file {str(file)!r} ({where}) does not exist")
    module_name = f"spmdrl_user_{kind}_{abs(hash(str(file.resolve())))}"
    mod_spec = importlib.util.spec_from_file_location(module_name, file)
    if mod_spec is None or mod_spec.loader is None:
        raise ImportError(f"{kind} file {str(file)!r} ({where}) cannot be imported as Python")
    module = importlib.util.module_from_spec(mod_spec)
    # Registered before running it, as importlib documents: dataclasses and pickle look modules up there.
    sys.modules[module_name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ImportError(f"importing {kind} file {str(file)!r} ({where}) failed: {e!r}") from e
    return module
