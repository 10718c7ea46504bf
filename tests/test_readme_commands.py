"""The README's commands stay true: the example it names runs, and .ci/run calls the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_example_runs() -> None:
    commands = _fenced_commands((ROOT / "README.md").read_text())
    scripts = [c.split()[1] for c in commands if c.startswith("python scripts/")]
    assert scripts, "README names no runnable script"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for script in scripts:
        result = subprocess.run([sys.executable, str(ROOT / script)], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}"


def test_ci_runs_the_readme_test_command() -> None:
    commands = _fenced_commands((ROOT / "README.md").read_text())
    test_commands = [c for c in commands if "pytest" in c and "-m slow" not in c]
    assert len(test_commands) == 1
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines
