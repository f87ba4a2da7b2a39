"""The job secret derived for single-host jobs without one (transport.local_secret, and the
policy in rendezvous.store_secret), without Slurm: file modes, refusals, the Slurm rules."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from security_helpers import outsider_fixture  # noqa: F401  (the `outsider` fixture)

from adapter.backends.transport import local_secret
from adapter.errors import ConfigError
from adapter.rendezvous import store_secret

ROOT = Path(__file__).resolve().parents[2]


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_RUNTIME_DIR": str(tmp_path), **extra}


def test_the_secret_file_is_0600_in_a_0700_directory_and_stable(tmp_path):
    first, path = local_secret.secret_for("job A", env(tmp_path))
    again, same_path = local_secret.secret_for("job A", env(tmp_path))
    other, _ = local_secret.secret_for("job B", env(tmp_path))
    assert first == again and path == same_path and len(first) == 32 and other != first
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.path.dirname(path) == str(tmp_path / f"jacklring-{os.getuid()}")
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".new-")]  # no leftovers


@pytest.mark.timeout(30)
def test_ranks_racing_to_create_it_read_one_secret(tmp_path):
    code = ("import sys; from adapter.backends.transport import local_secret; "
            "print(local_secret.secret_for('race', {'XDG_RUNTIME_DIR': sys.argv[1]})[0].hex())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(4)]
    values = {p.communicate(timeout=20)[0].strip() for p in procs}
    assert len(values) == 1 and len(values.pop()) == 64


def test_a_symlink_in_place_of_the_file_or_the_directory_is_refused(tmp_path):
    _, path = local_secret.secret_for("job", env(tmp_path))
    planted = tmp_path / "planted"
    planted.write_text("ab" * 32)
    planted.chmod(0o600)
    os.unlink(path)
    os.symlink(planted, path)
    with pytest.raises(ConfigError, match="symlink"):
        local_secret.secret_for("job", env(tmp_path))
    elsewhere = tmp_path / "other"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / f"jacklring-{os.getuid()}").symlink_to(tmp_path / f"jacklring-{os.getuid()}")
    with pytest.raises(ConfigError, match="not a directory"):
        local_secret.secret_for("job", env(elsewhere))


def test_an_open_mode_is_refused(tmp_path):
    _, path = local_secret.secret_for("job", env(tmp_path))
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match="open to other users"):
        local_secret.secret_for("job", env(tmp_path))
    os.chmod(path, 0o600)
    os.chmod(os.path.dirname(path), 0o755)
    with pytest.raises(ConfigError, match="open to other users"):
        local_secret.secret_for("job", env(tmp_path))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another uid")
def test_another_owners_file_or_directory_is_refused(tmp_path):
    _, path = local_secret.secret_for("job", env(tmp_path))
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        local_secret.secret_for("job", env(tmp_path))
    os.chown(path, 0, 0)
    os.chown(os.path.dirname(path), 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        local_secret.secret_for("job", env(tmp_path))


def test_which_jobs_get_a_derived_secret():
    job = store_secret.single_host_job
    assert job({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "torch 127.0.0.1:29500 run -"
    assert job({"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}) == \
        "torch 127.0.0.1:1 run x"
    torchrun_one_node = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "r",
                         "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert job(torchrun_one_node) == "torch 10.0.0.5:29500 run r"
    assert job({"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}) is None  # by hand, another host
    assert job({}, ("127.0.0.1", 4000)) == "torch 127.0.0.1:4000 run -"       # tcp://127.0.0.1:4000
    assert job({}, ("10.0.0.5", 4000)) is None
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"}
    assert job(step) == "slurm 77.3"
    uncounted = {k: v for k, v in step.items() if k != "SLURM_STEP_NUM_NODES"}
    assert job(uncounted, ("127.0.0.1", 4000)) == "torch 127.0.0.1:4000 run -"  # its store is on loopback
    with pytest.raises(ConfigError, match="spans several nodes"):
        job(uncounted)
    with pytest.raises(ConfigError, match=r"spans 2 nodes.*srun --export=ALL,JACKLRING_SECRET.*"
                                          r"JACKLRING_ALLOW_UNAUTHENTICATED=1"):
        job({**step, "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2"})


MULTI_NODE = {
    "torchrun, 2 nodes": {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"},
    "torchrun, node 1 of 2": {"GROUP_RANK": "1"},
    "a launcher's node count": {"NNODES": "3"},
    "Lightning's node rank": {"NODE_RANK": "1"},
}


@pytest.mark.parametrize("case", sorted(MULTI_NODE))
def test_a_job_spanning_hosts_is_refused_even_with_a_loopback_master_addr(case):
    """The engine says several nodes: refused, and the error says how to set a secret. A
    loopback MASTER_ADDR does not make it one host (on its own node a host name can resolve to
    127.0.1.1). Before, torchrun on several nodes only warned (key through the store)."""
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "r",
               **MULTI_NODE[case]}
    with pytest.raises(ConfigError, match=r"spans hosts.*JACKLRING_SECRET=.*JACKLRING_SECRET_FILE.*"
                                          r"JACKLRING_ALLOW_UNAUTHENTICATED=1"):
        store_secret.derived_secret(environ)
    assert store_secret.derived_secret({**environ, "JACKLRING_ALLOW_UNAUTHENTICATED": "1"}) is None


def test_listeners_beyond_loopback_without_a_single_host_identity_are_refused(tmp_path):
    """MASTER_ADDR set by hand to another host, the ring listening on a routable address:
    before, a warning; now a ConfigError. Loopback listeners keep the key through the store
    (nobody on another host reaches them); one host by torchrun's variables keeps its file."""
    by_hand = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "WORLD_SIZE": "2", **env(tmp_path)}
    with pytest.raises(ConfigError, match=r"listens on 10\.0\.0\.7, beyond loopback.*JACKLRING_SECRET"):
        store_secret.derived_secret(by_hand, None, "10.0.0.7")
    assert store_secret.derived_secret(by_hand, None, "127.0.0.1") is None
    one_node = {**by_hand, "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r"}
    assert len(store_secret.derived_secret(one_node, None, "10.0.0.7")) == 32


def test_the_opt_out_skips_derivation_and_the_slurm_refusal(monkeypatch):
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2"}
    with pytest.raises(ConfigError):
        store_secret.derived_secret(step)
    assert store_secret.derived_secret({**step, "JACKLRING_ALLOW_UNAUTHENTICATED": "1"}) is None


def test_secrets_unused_for_a_week_are_removed_when_a_new_one_is_made(tmp_path):
    _, old = local_secret.secret_for("old job", env(tmp_path))
    _, recent = local_secret.secret_for("recent job", env(tmp_path))
    week_ago = time.time() - local_secret.UNUSED_FOR_S - 60
    os.utime(old, (week_ago, week_ago))
    local_secret.secret_for("new job", env(tmp_path))
    assert not os.path.exists(old) and os.path.exists(recent)


@pytest.fixture(name="sticky_tmp")
def sticky_tmp_fixture():
    """A shared temporary directory like /tmp (mode 1777), private to this test."""
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="jacklring-sticky-")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("squat", ["directory", "symlink"])
def test_a_squatted_temporary_name_no_longer_stops_the_users_jobs(tmp_path, sticky_tmp, outsider, squat):
    """The outsider (uid 65534) creates $TMPDIR/jacklring-UID first (a directory, or a symlink to
    one of its own), in a sticky shared TMPDIR where the victim cannot remove it. Before, every
    job of the victim without a secret failed with a ConfigError; now the secret lives under the
    victim's home (a place only it can create), and the squat is ignored."""
    name = sticky_tmp / f"jacklring-{os.getuid()}"
    make = (f"import os; os.mkdir({str(name)!r}, 0o777); os.chmod({str(name)!r}, 0o777)" if squat == "directory"
            else f"import os; os.mkdir({str(sticky_tmp / 'mine')!r}, 0o777); "
                 f"os.symlink({str(sticky_tmp / 'mine')!r}, {str(name)!r})")
    attack = outsider_script(outsider, make + "\nprint('READY', flush=True)\n")
    assert attack.wait(20) == 0, attack.stderr.read()
    assert os.lstat(name).st_uid != os.getuid()  # the squat is in place, and not the victim's
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    value, path = local_secret.secret_for("job", {"TMPDIR": str(sticky_tmp), "HOME": str(home)})
    assert len(value) == 32 and path.startswith(str(home / ".cache" / "jacklring") + os.sep), path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    # without a home of its own, the shared name is all that is left: it fails closed, naming the owner
    with pytest.raises(ConfigError, match=r"uid 65534 \(nobody\)|uid 65534 \(no user name\)"):
        local_secret.secret_for("job", {"TMPDIR": str(sticky_tmp), "HOME": str(sticky_tmp)})


def outsider_script(outsider, source: str):
    """Run a one-off script as the outsider: the fixture runs scripts of attacks/ by name, so
    this one is handed over through its stdin."""
    proc = outsider("run_stdin.py")
    proc.stdin.write(source)
    proc.stdin.close()
    return proc
