"""Hostfile parsing: both forms, and one clear line for every kind of mistake."""
import json

import pytest
from conftest import launch

from launcher.hostfile import (
    Host,
    Hostfile,
    HostfileError,
    dump_hostfile,
    hosts_from_list,
    load_hostfile,
    parse_hostfile,
    parse_ssh_target,
)

pytestmark = pytest.mark.timeout(60)

GOOD_ROWS = [[None, "rdma_en2"], ["rdma_en2", None]]


def test_both_forms_parse_and_round_trip(tmp_path):
    listed = [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": GOOD_ROWS[0]},
              {"ssh": "root@b:2222", "ips": ["10.0.0.2"], "rdma": GOOD_ROWS[1]}]
    h = parse_hostfile(listed)
    assert [x.ssh for x in h.hosts] == ["a", "root@b:2222"] and h.backend == "" and h.envs == []
    obj = {"backend": "jaccl", "envs": ["A=1"], "hosts": listed}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(obj))
    loaded = load_hostfile(path)
    assert loaded.backend == "jaccl" and loaded.envs == ["A=1"]
    assert loaded.hosts[1].target.port == 2222 and loaded.hosts[1].target.user == "root"
    assert parse_hostfile(dump_hostfile(loaded)) == loaded


def test_hosts_list_repeats_like_mlx_launch():
    h = hosts_from_list("127.0.0.1,node", 2)
    assert [x.ssh for x in h.hosts] == ["127.0.0.1", "127.0.0.1", "node", "node"]
    assert h.hosts[0].ips == ["127.0.0.1"] and h.hosts[2].ips == []
    assert h.hosts[0].is_local and not h.hosts[2].is_local


@pytest.mark.parametrize("text,expected", [
    ("host", ("host", None, None)),
    ("me@host:22", ("host", "me", 22)),
    ("[::1]:2200", ("::1", None, 2200)),
    ("fe80::1", ("fe80::1", None, None)),
])
def test_ssh_targets(text, expected):
    t = parse_ssh_target(text)
    assert (t.host, t.user, t.port) == expected


BAD = [
    ("malformed_json", "[{\"ssh\": \"a\",]", "malformed JSON at line 1"),
    ("not_a_list", "3", "expected a list of hosts or an object with 'hosts', got a number"),
    ("empty", "[]", "the host list is empty"),
    ("unknown_backend", {"backend": "gloo", "hosts": [{"ssh": "a"}]}, "backend: unknown backend 'gloo'"),
    ("missing_hosts", {"backend": "ring"}, "missing 'hosts'"),
    ("typo_key", {"host": []}, "unknown key 'host'"),
    ("entry_not_object", ["a"], "hosts[0]: expected an object with 'ssh', got a string"),
    ("missing_ssh", [{"ips": ["1.2.3.4"]}], "hosts[0].ssh: missing"),
    ("ssh_not_string", [{"ssh": 5}], "hosts[0].ssh: expected a string, got a number"),
    ("bad_port", [{"ssh": "a:70000"}], "hosts[0].ssh: ssh target 'a:70000': port must be 1-65535"),
    ("ips_not_list", [{"ssh": "a", "ips": "1.2.3.4"}], "hosts[0].ips: expected a list"),
    ("ip_invalid", [{"ssh": "a", "ips": ["1.2.3"]}], "hosts[0].ips[0]: '1.2.3' is not an IP address"),
    ("unknown_field", [{"ssh": "a", "ip": ["1.2.3.4"]}], "hosts[0]: unknown field 'ip'"),
    ("ring_without_ips", {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["1.2.3.4"]}, {"ssh": "b"}]},
     "hosts[1].ips: the ring backend needs at least one IP per host"),
    ("rdma_wrong_shape", [{"ssh": "a", "rdma": [None, "x"]}, {"ssh": "b", "rdma": ["x"]}],
     "hosts[1].rdma: expected 2 entries (one per host), got 1"),
    ("rdma_missing_row", [{"ssh": "a", "rdma": [None, "x"]}, {"ssh": "b"}],
     "hosts[1].rdma: expected 2 entries (one per host), got 0"),
    ("rdma_diagonal", [{"ssh": "a", "rdma": [None, "x"]}, {"ssh": "b", "rdma": ["x", "y"]}],
     "hosts[1].rdma[1]: must be null"),
    ("rdma_cell_type", [{"ssh": "a", "rdma": [None, 3]}, {"ssh": "b", "rdma": ["x", None]}],
     "hosts[0].rdma[1]: expected null, a device name or a non-empty list of names, got a number"),
    ("envs_type", {"envs": "A=1", "hosts": [{"ssh": "a"}]}, "envs: expected a list"),
    ("env_item", {"envs": ["A"], "hosts": [{"ssh": "a"}]}, "envs[0]: expected \"KEY=VALUE\""),
    ("jaccl_no_ip", {"backend": "jaccl", "hosts": [{"ssh": "a"}]},
     "hosts[0].ips: the jaccl backend needs an IP for rank 0"),
]


@pytest.mark.parametrize("name,content,message", BAD, ids=[b[0] for b in BAD])
def test_every_hostfile_error_is_one_line_naming_entry_and_field(tmp_path, name, content, message):
    path = tmp_path / f"{name}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(HostfileError) as info:
        load_hostfile(path)
    assert message in str(info.value) and str(info.value).startswith(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,content,message",
                         [BAD[0], BAD[3], BAD[13], BAD[14], BAD[16]],
                         ids=["malformed_json", "unknown_backend", "ring_without_ips",
                              "rdma_wrong_shape", "rdma_diagonal"])
def test_cli_prints_one_error_line_and_exits_2(tmp_path, name, content, message):
    path = tmp_path / f"{name}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    r = launch("--hostfile", path, "envdump.py")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("launcher: error: ") and message in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--hostfile", "/nonexistent.json", "x.py"], "cannot read hostfile"),
    (["--backend", "ring", "--hosts", "node1,node2", "x.py"], "the ring backend needs at least one IP"),
    (["--env", "NOEQUALS", "x.py"], "--env 'NOEQUALS': expected KEY=VALUE"),
    (["-n", "2"], "no script or command given"),
    (["--cwd", "/nonexistent/dir", "x.py"], "--cwd /nonexistent/dir: no such directory"),
])
def test_cli_usage_errors(args, message):
    r = launch(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("launcher: error: ") and message in r.stderr


def test_missing_file_message():
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        load_hostfile("/nonexistent/hosts.json")
    assert Hostfile(hosts=[Host("a")]).hosts[0].rdma == []
