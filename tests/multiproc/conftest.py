"""The multi-process tier's ranks (dist_utils.spawn) stay up across its tests; they end with the tier, not
with the session, so that the tiers after it have the memory back."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import close_all

HERE = Path(__file__).parent


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        close_all()
