"""A ring hostfile that spans hosts, started without a job secret (MLX_HOSTFILE by hand or by
mlx.launch): before, the ranks derived their key from the hostfile, which every user of either
host can read, so an outsider there injected data at once. Now every rank refuses to form,
naming JACKLRING_SECRET, JACKLRING_SECRET_FILE and the opt-out. Rank 0 runs in one network
namespace, rank 1 in another joined by a veth pair (two hosts), and the outsider (uid 65534,
standard library only) in rank 1's namespace tries its injection into rank 0. Needs root."""
from __future__ import annotations

import json
import time

import netns
import numpy as np
import pytest
from faults.cluster import finish_all, rank_envs, reports, start, stop_all
from security_helpers import INJECTION_TARGET, outsider_fixture  # noqa: F401  (the `outsider` fixture)

from adapter.backends.elements import dtype_code


@pytest.fixture(name="veth")
def veth_fixture():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with netns.veth_pair("10.201") as pair:
            yield pair
    except RuntimeError as exc:
        pytest.skip(str(exc))


def without_secret(env: dict[str, str]) -> dict[str, str]:
    """rank_envs gives ranks on several hosts a secret (as the launcher would): not here."""
    return {k: v for k, v in env.items() if k != "JACKLRING_SECRET"}


# What a refusal names: the two ways to give a secret and the explicit opt-out.
REFUSAL_NAMES = ("JACKLRING_SECRET=", "JACKLRING_SECRET_FILE=", "JACKLRING_ALLOW_UNAUTHENTICATED=1")


def start_across(backend: str, body: str, tmp_path, veth, envs: list[dict[str, str]],
                 env: dict[str, str] | None = None) -> list:
    """Two ranks of `backend`, rank q in network namespace q (two hosts)."""
    return start(backend, 2, body, tmp_path, envs=envs, env=env,
                 wraps={0: veth.exec_prefix(0), 1: veth.exec_prefix(1)})


def assert_refused(procs: list, codes: list[int], report: str, wording: str) -> None:
    """Nothing got in, no rank formed, and each said ConfigError with `wording` and every name."""
    assert not any(p.tagged("GOT") for p in procs), report
    for p, code in zip(procs, codes):
        assert code != 0 and not p.tagged("FORMED"), report
        said = p.stdout + p.stderr  # the rank's INITERR line, or a traceback
        assert "ConfigError" in said and wording in said, report
        assert all(name in said for name in REFUSAL_NAMES), report


@pytest.mark.timeout(120)
def test_a_hostfile_spanning_hosts_without_a_secret_is_refused_and_nothing_gets_in(tmp_path, veth, outsider):
    envs = [without_secret(e) for e in rank_envs("ring", 2, tmp_path, hosts=list(veth.addresses))]
    addresses = json.loads((tmp_path / "ring-hosts.json").read_text())
    begin = time.monotonic()
    procs = start_across("ring", INJECTION_TARGET, tmp_path, veth, envs,
                         {"FAULT_DIR": str(tmp_path), "JACKLRING_CONNECT_TIMEOUT": "20"})
    try:
        until = time.monotonic() + 40  # formed (before) or refused (now)
        while time.monotonic() < until and not all(p.popen.poll() is not None or p.tagged("FORMED") for p in procs):
            time.sleep(0.05)
        settled = time.monotonic() - begin
        attack = outsider("inject.py", addresses[0][0], json.dumps(addresses), 1, 0,
                          dtype_code(np.dtype(np.float64)), wrap=veth.exec_prefix(1))
        out, err = attack.communicate(timeout=30)
        (tmp_path / "go").touch()
        codes = finish_all(procs, 30)
    finally:
        stop_all(procs)
    report = reports(procs) + out + err
    assert "ack status 0" not in out, report  # no forged handshake completed
    assert_refused(procs, codes, report, "names hosts other than this one")
    assert settled < 30, f"refused after {settled:.1f} s, not at once"


@pytest.mark.timeout(120)
def test_the_same_hostfile_forms_with_the_opt_out(tmp_path, veth):
    """The refusal is about the secret alone: with the opt-out the two hosts form and sum."""
    envs = [without_secret(e) for e in rank_envs("ring", 2, tmp_path, hosts=list(veth.addresses))]
    _forms_and_sums("ring", tmp_path, veth, envs, {"JACKLRING_ALLOW_UNAUTHENTICATED": "1"})


def _forms_and_sums(backend: str, tmp_path, veth, envs: list[dict], extra: dict | None = None) -> None:
    """The two ranks across the two hosts form their group and sum."""
    procs = start_across(backend, "say('SUM', float(all_sum(np.ones(4))[0]))", tmp_path, veth, envs, extra)
    try:
        codes = finish_all(procs, 60)
    finally:
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
    assert all(p.tagged("SUM")[0][2:] == ["2.0"] for p in procs), reports(procs)


# JACCL names one address, the coordinator (MLX_JACCL_COORDINATOR, as mlx.launch writes it):
# the same two hosts, rank 0 and the coordinator in the first, rank 1 in the second. The
# outsider in the second host claims rank 1 at the coordinator with the key public facts give
# (fake_peer.py). Before, the group formed without a secret; now both ranks refuse at once.


@pytest.mark.timeout(120)
def test_a_jaccl_coordinator_on_another_host_without_a_secret_is_refused(tmp_path, veth, outsider):
    envs = [without_secret(e) for e in rank_envs("jaccl", 2, tmp_path, hosts=list(veth.addresses))]
    devices = json.loads((tmp_path / "jaccl-devices.json").read_text())
    begin = time.monotonic()
    procs = start_across("jaccl", INJECTION_TARGET, tmp_path, veth, envs,
                         {"FAULT_DIR": str(tmp_path), "JACKLRING_CONNECT_TIMEOUT": "20"})
    try:
        attack = outsider("fake_peer.py", envs[0]["MLX_JACCL_COORDINATOR"], json.dumps(devices), 3,
                          wrap=veth.exec_prefix(1))
        out, err = attack.communicate(timeout=30)
        (tmp_path / "go").touch()
        codes = finish_all(procs, 40)
        settled = time.monotonic() - begin
    finally:
        stop_all(procs)
    report = reports(procs) + out + err
    assert_refused(procs, codes, report, "host other than this one")
    assert settled < 30, f"refused after {settled:.1f} s, not at once"


@pytest.mark.timeout(120)
def test_the_same_jaccl_group_forms_across_hosts_with_a_secret(tmp_path, veth):
    """The refusal is about the secret alone: with one (rank_envs hands it out, as the
    launcher does) the two hosts form and sum."""
    envs = rank_envs("jaccl", 2, tmp_path, hosts=list(veth.addresses))
    assert all("JACKLRING_SECRET" in e for e in envs)
    _forms_and_sums("jaccl", tmp_path, veth, envs)


@pytest.mark.timeout(60)
def test_a_jaccl_newcomer_on_another_host_without_a_secret_is_refused(tmp_path, veth):
    """A replacement (JACKLRING_JOIN=1) whose coordinator is on another host would grow the group
    across hosts under the public key: refused at once with the same ConfigError (before, it
    knocked for its whole connect timeout)."""
    envs = [without_secret(e) for e in rank_envs("jaccl", 2, tmp_path, hosts=list(veth.addresses))]
    begin = time.monotonic()
    procs = start("jaccl", 2, "say('JOINED')", tmp_path, envs=envs, ranks=[1],
                  env={"JACKLRING_JOIN": "1", "JACKLRING_CONNECT_TIMEOUT": "20"}, wraps={1: veth.exec_prefix(1)})
    try:
        codes = finish_all(procs, 40)
    finally:
        stop_all(procs)
    said = procs[0].stdout + procs[0].stderr
    assert codes[0] != 0 and "ConfigError" in said and "host other than this one" in said, reports(procs)
    assert all(name in said for name in REFUSAL_NAMES), said
    assert time.monotonic() - begin < 15, reports(procs)
