"""The README's commands stay true: the example it names runs, and .ci/run calls the README's test command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_example_runs(tmp_path: Path) -> None:
    """Every ``python scripts/...`` line runs as written; hydra scripts write their run dir under ``tmp_path``."""
    commands = _fenced_commands((ROOT / "README.md").read_text())
    script_commands = [c.split()[1:] for c in commands if c.startswith("python scripts/")]
    assert script_commands, "README names no runnable script"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for script, *args in script_commands:
        run_dir = tmp_path / Path(script).stem
        if "@hydra.main" in (ROOT / script).read_text():
            args = [*args, f"hydra.run.dir={run_dir}"]
        result = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}"
        if script == "scripts/train.py":  # the main job: results on disk and the loss falling, as the README says
            metrics = json.loads((run_dir / "metrics.json").read_text())
            assert metrics["final_loss"] < metrics["first_loss"], metrics
            assert (run_dir / "checkpoints").is_dir()


def test_ci_runs_the_readme_test_command() -> None:
    commands = _fenced_commands((ROOT / "README.md").read_text())
    test_commands = [c for c in commands if "pytest" in c and "-m slow" not in c]
    assert len(test_commands) == 1
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines
