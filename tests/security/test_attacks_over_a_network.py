"""The injection attack of test_attacks.py from another host: the job's ranks run in one network
namespace, listening on its veth address, and the outsider (another uid, standard library only)
runs in a second namespace joined to the first by the veth pair, so its connections arrive over
a network link with their own source address, never over loopback or a Unix socket. It
computes every token public facts give (the old protocol's and the new one's, and the key
derived from the addresses) and sends a forged point-to-point message: with a job secret it is
rejected and the job completes with the right result; without one it gets in, which is the
documented limit (docs/security.md) and shows that its tokens are the right ones. Needs root
(namespaces, setpriv); skipped otherwise."""
from __future__ import annotations

import json
import secrets

import netns
import numpy as np
import pytest
from faults.cluster import finish_all, rank_envs, reports, start, stop_all
from security_helpers import (  # noqa: F401  (the `outsider` fixture)
    INJECTION_TARGET,
    outsider_fixture,
    sum_beside_a_squatter,
    wait_ready,
)

from adapter.backends.elements import dtype_code


@pytest.fixture(name="veth")
def veth_fixture():
    """Namespace 0 for the job (10.200.X.1), namespace 1 for the outsider (10.200.X.2)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with netns.veth_pair("10.200") as pair:
            yield pair
    except RuntimeError as exc:  # raised before the yield only: the namespaces could not be made
        pytest.skip(str(exc))


def _attack(tmp_path, veth, outsider, env):
    """Run the job in namespace 0 and inject.py in namespace 1; (rank processes, exit codes,
    the outsider's stdout and stderr)."""
    job_host = veth.addresses[0]
    envs = rank_envs("ring", 2, tmp_path, hosts=[job_host, job_host])
    addresses = json.loads((tmp_path / "ring-hosts.json").read_text())
    procs = start("ring", 2, INJECTION_TARGET, tmp_path, envs=envs, env={**env, "FAULT_DIR": str(tmp_path)},
                  wrap=veth.exec_prefix(0))
    try:
        for p in procs:
            p.wait_line("FORMED", 40)
        attack = outsider("inject.py", addresses[0][0], json.dumps(addresses), 1, 0,
                          dtype_code(np.dtype(np.float64)), wrap=veth.exec_prefix(1))
        out, err = attack.communicate(timeout=30)
        (tmp_path / "go").touch()
        codes = finish_all(procs, 30)
    finally:
        stop_all(procs)
    # every attempt reached rank 0 over the veth link
    assert out.count("OUTCOME") == 4, out + err
    return procs, codes, out, err


@pytest.mark.timeout(90)
def test_injection_from_another_network_namespace_is_rejected(tmp_path, veth, outsider):
    procs, codes, out, err = _attack(tmp_path, veth, outsider, {"JACKLRING_SECRET": secrets.token_hex(32)})
    assert codes == [0, 0], reports(procs) + out + err
    assert procs[0].tagged("GOT")[0][2:] == [f"{float(v)}" for v in range(10)], reports(procs)
    assert "ack status 0" not in out, out  # no handshake completed
    # each attempt was rejected and logged with its source address in the other namespace
    assert procs[0].stderr.count(f"unauthenticated connection from {veth.addresses[1]}:") >= 4, reports(procs)


@pytest.mark.timeout(90)
def test_without_a_secret_the_same_outsider_gets_in(tmp_path, veth, outsider):
    """The control: the attack above is a real one (its tokens and key are right), so only the
    secret stops it."""
    # rank 1's own message then finds rank 0 gone: a short connect deadline ends it soon
    procs, _, out, err = _attack(tmp_path, veth, outsider, {"JACKLRING_CONNECT_TIMEOUT": "5"})
    assert "ack status 0" in out, out + err
    assert procs[0].tagged("GOT")[0][2:] == ["666.0"] * 10, reports(procs)


@pytest.mark.timeout(60)
def test_squatted_unix_names_of_a_non_loopback_address_never_give_a_wrong_sum(tmp_path, veth, outsider):
    """Ranks of one host listening on its veth address meet over Unix sockets named after that
    address (not only on loopback): an outsider of another uid in the same namespace who holds
    those names first is detected by its uid and reported; the ranks use TCP and sum right (the
    collectives forced onto the sockets, where a tampering relay would show)."""
    job_host = veth.addresses[0]
    envs = rank_envs("ring", 2, tmp_path, hosts=[job_host, job_host])
    addresses = [a[0] for a in json.loads((tmp_path / "ring-hosts.json").read_text())]
    relay = outsider("relay.py", *addresses, wrap=veth.exec_prefix(0))
    wait_ready(relay)
    sum_beside_a_squatter(tmp_path, envs, {"JACKLRING_LOCAL_TRANSPORT": "unix"}, wrap=veth.exec_prefix(0))
