"""JACCL environment validation: every bad input is a ConfigError naming the file and cell, raised
before any connection is attempted (nothing listens at the coordinator in these tests)."""
from __future__ import annotations

import json

import pytest

from adapter.backends.jaccl import backend as jaccl
from adapter.backends.jaccl import config as jaccl_config
from adapter.errors import ConfigError

GOOD = [[None, "rdma_en2", "rdma_en3"], ["rdma_en2", None, ["rdma_en3", "rdma_en4"]], ["rdma_en3", "rdma_en4", None]]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Point MLX_IBV_DEVICES at a file holding the given text; a closed coordinator port."""
    path = tmp_path / "devices.json"

    def setup(content, rank="0", **extra):
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        monkeypatch.setenv("MLX_IBV_DEVICES", str(path))
        monkeypatch.setenv("MLX_RANK", rank)
        monkeypatch.setenv("MLX_JACCL_COORDINATOR", "127.0.0.1:9")
        monkeypatch.setenv("JACKLRING_CONNECT_TIMEOUT", "30")
        monkeypatch.delenv("MLX_JACCL_RING", raising=False)
        monkeypatch.delenv("JACKLRING_JACCL_TRANSPORT", raising=False)
        for key, value in extra.items():
            monkeypatch.setenv(key, value)
        return str(path)
    return setup


def create_error(timeout: float = 5.0) -> str:
    with pytest.raises(ConfigError) as info:
        jaccl.create(timeout=timeout)
    return str(info.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("content, words", [
    ("[[null, \"a\"], [\"a\", null]", "not valid JSON"),
    ({"rows": 2}, "non-empty JSON list"),
    ([], "non-empty JSON list"),
    ([[None, "a"], "row"], "row 1 is str"),
    ([[None, "a", "b"], ["a", None, "c"]], "square"),
    ([[None, "a"], ["a", None], ["b", "c"]], "row 0 has 2 cells"),
    ([["x", "a"], ["a", None]], "cell [0][0] must be null"),
    ([[None, 5], [5, None]], "cell [0][1] must be null, a device name"),
    ([[None, ["a", 3]], ["a", None]], "cell [0][1]"),
    ([[None, "a", "b", None], ["a", None, None, None], ["b", None, None, "c"], [None, None, "c", None]],
     "empty cells"),
])
def test_bad_matrix_is_named(env, content, words):
    path = env(content)
    message = create_error()
    assert path in message and words in message, message


@pytest.mark.timeout(10)
def test_unreadable_file(env, monkeypatch, tmp_path):
    env(GOOD)
    monkeypatch.setenv("MLX_IBV_DEVICES", str(tmp_path / "missing.json"))
    message = create_error()
    assert "missing.json" in message and "cannot read" in message


@pytest.mark.timeout(10)
def test_rank_out_of_range_names_the_file(env):
    path = env(GOOD, rank="3")
    message = create_error()
    assert "MLX_RANK=3" in message and path in message and "3 ranks" in message


@pytest.mark.timeout(10)
def test_ring_preference_needs_ring_links(env):
    # 0-1 and 1-2 linked, 2-0 not: no mesh and no ring (the ring wraps around)
    path = env([[None, "a", None], ["a", None, "b"], [None, "b", None]], MLX_JACCL_RING="1")
    message = create_error()
    assert path in message and "ring" in message and "[0][2]" in message and "[2][0]" in message


@pytest.mark.timeout(10)
def test_bad_coordinator_and_transport(env, monkeypatch):
    env(GOOD)
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "127.0.0.1")
    assert "MLX_JACCL_COORDINATOR" in create_error()
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("JACKLRING_JACCL_TRANSPORT", "carrier-pigeon")
    assert "JACKLRING_JACCL_TRANSPORT" in create_error()


def test_mode_selection_follows_mlx():
    mesh = jaccl_config.parse_devices(json.dumps(GOOD), "test")
    assert jaccl_config.choose_mode(mesh, prefer_ring=False, source="t") == jaccl_config.MESH
    # a full mesh also satisfies the ring: MLX_JACCL_RING picks the ring
    assert jaccl_config.choose_mode(mesh, prefer_ring=True, source="t") == jaccl_config.RING
    ring4 = [[None, "a", None, "d"], ["a", None, "b", None], [None, "b", None, "c"], ["d", None, "c", None]]
    ring = jaccl_config.parse_devices(json.dumps(ring4), "t")
    assert jaccl_config.choose_mode(ring, prefer_ring=False, source="t") == jaccl_config.RING
    two = jaccl_config.parse_devices(json.dumps([[None, "a"], ["a", None]]), "t")
    assert jaccl_config.choose_mode(two, prefer_ring=False, source="t") == jaccl_config.MESH
    assert mesh[1][2] == ["rdma_en3", "rdma_en4"]  # a list cell = several cables


def test_matrix_of_nulls_is_an_uncabled_mesh_and_one_rank_is_a_group_of_one():
    """What `launcher --backend jaccl -n N` writes without a hostfile: no cabling is described,
    so the TCP mesh links every pair (mesh, or ring when preferred); RDMA is impossible."""
    nulls = jaccl_config.parse_devices(json.dumps([[None] * 3] * 3), "t")
    assert not jaccl_config.lists_devices(nulls)
    assert jaccl_config.choose_mode(nulls, prefer_ring=False, source="t") == jaccl_config.MESH
    assert jaccl_config.choose_mode(nulls, prefer_ring=True, source="t") == jaccl_config.RING
    assert jaccl_config.lists_devices(jaccl_config.parse_devices(json.dumps(GOOD), "t"))
    assert jaccl_config.choose_mode([[[]]], prefer_ring=False, source="t") == jaccl_config.MESH


@pytest.mark.timeout(10)
def test_one_rank_matrix_is_a_group_of_one(env):
    env([[None]])
    backend = jaccl.create(timeout=5)
    assert (backend.rank(), backend.size()) == (0, 1)


def test_probe_names_missing_variables(monkeypatch):
    for name in ("MLX_RANK", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert "MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES are not set" in jaccl.probe()
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "127.0.0.1:1")
    assert jaccl.probe() == "MLX_IBV_DEVICES is not set"
    monkeypatch.setenv("MLX_IBV_DEVICES", "/nonexistent")
    assert jaccl.probe() is None  # present; create() validates it
