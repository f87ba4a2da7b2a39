"""Inline execution of synchronous collectives on the torch "jacklring" group (docs/torch.md,
"Execution model"), in real rank processes."""
from __future__ import annotations

import pytest
import torch_harness as harness

pytest.importorskip("torch")


@pytest.mark.timeout(90)
def test_synchronous_collectives_run_inline_and_async_ones_keep_order_and_callbacks():
    harness.assert_all_ok(harness.run(2, "inline.py", timeout=80), marker="INLINE ALL OK")
