"""Security-test fixtures: the controller tests' launcher stack (``python -m deploy.launcher up``), reused as is.

The stack helpers live in ``tests/integration/controller/conftest.py``; they are loaded from that file (the
suite runs with ``--import-mode=importlib``, so one conftest cannot import another by name) and their
fixtures re-exported here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "controller" / "conftest.py"
_spec = importlib.util.spec_from_file_location("_security_stack_helpers", _PATH)
helpers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = helpers  # its dataclass (Stack) looks its module up while being defined
_spec.loader.exec_module(helpers)

stacks = helpers.stacks
stack = helpers.stack
