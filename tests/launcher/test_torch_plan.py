"""What the launcher plans for torch's process group: under --backend jaccl the torch group
runs on JACCL (JACKLRING_TORCH_BACKEND=jaccl), which --env may still override."""
from launcher.environment import LaunchOptions, plan_ranks
from launcher.hostfile import Host


def _hosts(n: int) -> list[Host]:
    return [Host(ssh="127.0.0.1", ips=["127.0.0.1"], rdma=[None] * n) for _ in range(n)]


def test_backend_jaccl_plans_the_torch_group_on_jaccl(monkeypatch):
    monkeypatch.delenv("JACKLRING_TORCH_BACKEND", raising=False)
    for backend in ("jaccl", "jaccl-ring"):
        plans = plan_ranks(_hosts(2), LaunchOptions(backend=backend))
        assert [p.env.get("JACKLRING_TORCH_BACKEND") for p in plans] == ["jaccl", "jaccl"], backend
    ring = plan_ranks(_hosts(2), LaunchOptions(backend="ring"))
    assert all("JACKLRING_TORCH_BACKEND" not in p.env for p in ring)


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.delenv("JACKLRING_TORCH_BACKEND", raising=False)
    plans = plan_ranks(_hosts(2), LaunchOptions(backend="jaccl", envs=["JACKLRING_TORCH_BACKEND=ring"]))
    assert [p.env["JACKLRING_TORCH_BACKEND"] for p in plans] == ["ring", "ring"]
    monkeypatch.setenv("JACKLRING_TORCH_BACKEND", "ring")
    plans = plan_ranks(_hosts(2), LaunchOptions(backend="jaccl"))
    assert all("JACKLRING_TORCH_BACKEND" not in p.env for p in plans)  # the inherited one stands
