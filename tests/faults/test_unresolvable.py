"""A host name that does not resolve (ring hostfile, JACCL coordinator) is a ConfigError on every
rank within a second of init(), with a 120 s connect deadline (it used to be a PeerError on one
rank while the others retried until the deadline)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster import ROOT, base_env, rank_envs

BAD = "no-such-host.invalid"
LIMIT_S = 1.0

# Times init() alone (importing numpy and adapter on a loaded machine takes about as long):
# adapter loads its modules on first use, so the script loads init's first.
SCRIPT = """
import importlib, sys, time
import adapter
importlib.import_module("adapter.group")
importlib.import_module(f"adapter.backends.{sys.argv[1]}.backend")
start = time.monotonic()
try:
    adapter.init(strict=True, backend=sys.argv[1])
    print("NOERR")
except adapter.DistributedError as exc:
    print(f"{time.monotonic() - start:.3f}", type(exc).__name__, str(exc).replace("\\n", " "))
"""


def run_ranks(backend: str, envs: list[dict[str, str]]) -> list[tuple[float, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, backend], cwd=str(ROOT), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=base_env(JACKLRING_CONNECT_TIMEOUT="120", **env)) for env in envs]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
        took, _, text = out.strip().partition(" ")
        assert took != "NOERR" and text, out + err
        results.append((float(took), text))
    for took, text in results:
        assert text.startswith("ConfigError") and BAD in text, text
        assert took < LIMIT_S, f"ConfigError only after {took:.2f} s: {text}"
    return results


@pytest.mark.timeout(60)
def test_ring_hostfile_with_an_unresolvable_host(tmp_path):
    envs = rank_envs("ring", 3, tmp_path)
    hostfile = tmp_path / "ring-hosts.json"
    entries = json.loads(hostfile.read_text())
    entries[2] = [f"{BAD}:5000"]
    hostfile.write_text(json.dumps(entries))
    print(run_ranks("ring", envs))


@pytest.mark.timeout(60)
def test_jaccl_unresolvable_coordinator(tmp_path):
    envs = rank_envs("jaccl", 3, tmp_path)
    for env in envs:
        env["MLX_JACCL_COORDINATOR"] = f"{BAD}:5000"
    print(run_ranks("jaccl", envs))
