"""`torch.distributed.monitored_barrier` on a jacklring group answers without the program's
help (routed when the first jacklring group forms), and JACKLRING_TORCH_MONITORED_BARRIER=0
turns that off (torch's own refusal then). The routed barrier's behaviour at three ranks (a
late rank named, the group usable after) is tests/torch/test_three_rank_launch.py's."""
import pytest
import torch_harness as harness

pytest.importorskip("torch")


@pytest.mark.timeout(150)
def test_the_setting_turns_the_routing_off_and_on():
    env = harness.clean_env(JACKLRING_TORCH_MONITORED_BARRIER="0")
    results = harness.run(2, "monitored_switch.py", timeout=120, env=env)
    harness.assert_all_ok(results, "SWITCH ALL OK")
