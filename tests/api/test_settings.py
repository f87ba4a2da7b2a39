"""The settings table: every JACKLRING_* variable declared once, documented, read when used, and
a malformed value reported by name at use time (never at import or by is_available)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ranks

from adapter import config
from adapter.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"JACKLRING_[A-Z0-9_]*[A-Z0-9]")
# Reading a JACKLRING_* variable anywhere but adapter/config.py (setting one for a child is fine).
DIRECT_READ = re.compile(r"""(getenv\(|environ\.get\(|environ\[)\s*["']JACKLRING_[A-Z0-9_]+["']\s*\]?(?!\s*=[^=])""")


def shipped_sources() -> list[Path]:
    return sorted(p for top in ("adapter", "launcher") for p in (REPO / top).rglob("*.py"))


def test_every_name_in_shipped_code_and_docs_is_declared() -> None:
    undeclared = {}
    for path in shipped_sources() + sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for name in NAME.findall(path.read_text()):
            if name not in config.SETTINGS:
                undeclared.setdefault(name, str(path.relative_to(REPO)))
    assert not undeclared, f"declare these in adapter/config.py SETTINGS: {undeclared}"


def test_every_setting_is_documented_with_its_meaning() -> None:
    doc = (REPO / "docs" / "environment.md").read_text()
    for setting in config.SETTINGS.values():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{setting.name}` |")), None)
        assert row is not None, f"docs/environment.md has no row for {setting.name}"
        assert setting.meaning in row, f"docs/environment.md: {setting.name}'s meaning differs from adapter/config.py"


def test_nothing_reads_a_setting_behind_the_table() -> None:
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in shipped_sources() if path.name != "config.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if DIRECT_READ.search(line)]
    assert not offenders, f"read these through adapter.config.get: {offenders}"


@pytest.mark.parametrize("raw, value", [("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("64 kb", 65536),
                                        ("1M", 1 << 20), ("1G", 1 << 30), ("0", 0)])
def test_sizes_take_binary_suffixes(raw: str, value: int) -> None:
    assert config.get("JACKLRING_RING_SMALL_BYTES", {"JACKLRING_RING_SMALL_BYTES": raw}) == value


@pytest.mark.parametrize("name, raw", [("JACKLRING_RING_SMALL_BYTES", "lots"), ("JACKLRING_TIMEOUT", "soon"),
                                       ("JACKLRING_TIMEOUT", "-1"), ("JACKLRING_VERIFY", "maybe"),
                                       ("JACKLRING_LOCAL_TRANSPORT", "pigeon"), ("JACKLRING_RING_DIRECTIONS", "3"),
                                       ("JACKLRING_SPIN_US", "-5"), ("JACKLRING_MPI_MAX_COUNT", "0")])
def test_a_malformed_value_is_a_config_error_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{name}={raw!r}")):
        config.get(name, {name: raw})


@pytest.mark.parametrize("raw", ["0", "0.0", "0e0"])
def test_stall_report_zero_means_off(raw: str) -> None:
    assert config.get("JACKLRING_STALL_REPORT", {"JACKLRING_STALL_REPORT": raw}) is None


def test_unset_and_empty_give_the_default() -> None:
    for setting in config.SETTINGS.values():
        assert config.get(setting.name, {}) == setting.default
        assert config.get(setting.name, {setting.name: " "}) == setting.default


@pytest.mark.timeout(60)
def test_malformed_settings_break_neither_import_nor_is_available_only_init(tmp_path: Path) -> None:
    """Formerly JACKLRING_PINNED_CACHE_BYTES=1G broke `import adapter` and a malformed
    JACKLRING_RING_SMALL_BYTES made is_available("ring") raise ValueError."""
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]))
    code = ("import adapter\n"
            "assert adapter.is_available('ring') and adapter.is_available()\n"
            "try:\n    adapter.init(backend='ring')\n"
            "except adapter.ConfigError as exc:\n    print('CONFIG', exc)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), MLX_RANK="0", MLX_HOSTFILE=str(hostfile),
               JACKLRING_PINNED_CACHE_BYTES="lots", JACKLRING_RING_SMALL_BYTES="lots", JACKLRING_SPIN_US="soon")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "CONFIG JACKLRING_" in result.stdout and "'lots'" in result.stdout + "'soon'", result.stdout


TORCH_TIMEOUT_SCRIPT = """
import datetime, os, sys, time
os.environ["RANK"] = os.environ["MLX_RANK"]  # the launcher's torch variables; the test sets the rest
import torch, torch.distributed as dist
import adapter, adapter.torch_backend
adapter.init()  # the numpy API's group first, with the default deadline; torch's group splits from it
adapter.torch_backend.register_backend()
dist.init_process_group("jacklring", timeout=datetime.timedelta(seconds=2))
raised = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raised")
if dist.get_rank() == 1:
    # Absent for 8 s (rank 0 waiting out a longer deadline would see it leave then), or until rank 0 raised.
    until = time.monotonic() + 8
    while not os.path.exists(raised) and time.monotonic() < until:
        time.sleep(0.05)
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(3))
except Exception as exc:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
open(raised, "w").close()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_the_torch_group_timeout_reaches_the_backend(tmp_path: Path, backend: str) -> None:
    """init_process_group(timeout=2 s) must bound a collective on every backend, also when
    adapter.init() formed the group first; JACCL's split used to keep the 300 s deadline, so
    rank 0 waited until rank 1 exited (8 s)."""
    pytest.importorskip("torch")
    script = tmp_path / "timeout.py"
    script.write_text(TORCH_TIMEOUT_SCRIPT)
    # The environment contract set by hand (ranks.spawn, forked from the zygote): the point is the
    # deadline reaching the backend, not how the ranks started. adapter.init() gets the default
    # deadline (300 s) whatever the shell sets.
    env = {"JACKLRING_TORCH_BACKEND": backend, "OMP_NUM_THREADS": "1", "JACKLRING_TIMEOUT": "300",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ranks.free_ports(1)[0]),
           **(ranks.jaccl_env(2, str(tmp_path)) if backend == "jaccl" else {})}
    found = ranks.run(2, str(script), env=env, timeout=80)
    out = "".join(f"--- rank {r.rank} exited {r.returncode}\n{r.stdout}{r.stderr[-3000:]}" for r in found)
    match = re.search(r"RAISED after ([\d.]+) s", found[0].stdout)
    assert match, out
    assert float(match.group(1)) < 6, match.group(0)
