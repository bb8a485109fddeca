"""kimi_helix.assets: the drafter shipped beside the demo model, used when no drafter is named."""

from __future__ import annotations

import pytest

from kimi_helix import assets


def test_default_drafter_is_the_shipped_one_for_the_demo_model_only(tmp_path, monkeypatch):
    drafter = tmp_path / "drafter"
    monkeypatch.setattr(assets, "DEMO_DRAFTER_DIR", drafter)
    assert assets.default_drafter_dir(assets.DEMO_DIR) is None  # not shipped (yet)
    with pytest.raises(FileNotFoundError, match="drafter"):
        assets.demo_drafter_dir()
    drafter.mkdir()
    (drafter / assets.DEMO_WEIGHTS).write_bytes(b"")
    assert assets.default_drafter_dir(assets.DEMO_DIR) == drafter == assets.demo_drafter_dir()
    assert assets.default_drafter_dir(str(assets.DEMO_DIR / ".." / "demo")) == drafter
    assert assets.default_drafter_dir(tmp_path) is None and assets.default_drafter_dir(None) is None
