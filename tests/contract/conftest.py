from __future__ import annotations

import pytest

from .launches import Launches


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Every launch the selected contract tests need, started in the background on first use."""
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "variant" not in callspec.params:
            continue
        if any(m.name == "skip" for m in item.iter_markers()):
            continue
        key = (callspec.params["variant"], callspec.params["size"], callspec.params.get("mode", ""))
        if key not in wanted:
            wanted.append(key)
    pool = Launches(tmp_path_factory.mktemp("contract"), wanted)
    yield pool
    pool.close()
