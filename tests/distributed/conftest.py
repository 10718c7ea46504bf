"""Lets the processes that ``run_ranks`` spawns import this folder's modules.

(The folder is not called ``tests/dist``: ``dist`` is in pytest's default ``norecursedirs``, so a plain
``pytest`` run would silently skip it.)

pytest (importlib mode) names these modules ``tests.distributed.<name>``, and a spawned rank unpickles its function
by that name, so the repository root must be on ``sys.path`` in the parent when it spawns (children inherit it). It
is under ``python -m pytest`` (the documented command); the bare ``pytest`` script does not add it, and without this
every spawned rank would fail to import and the test would wait for its timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)
