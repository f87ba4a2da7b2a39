"""The linter configured in pyproject.toml ([tool.ruff]) passes on the whole repository."""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff)] if ruff.exists() else [shutil.which("ruff") or "ruff"]
    result = subprocess.run([*command, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
