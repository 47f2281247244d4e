"""The README's two test tiers: what tests/conftest.py sends to the full tier still exists, so
that a renamed slow test cannot drift into `make check` unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import FULL_TIER_PATHS, FULL_TIER_TESTS

ROOT = Path(__file__).resolve().parents[2]


def test_every_full_tier_entry_names_a_test_that_exists() -> None:
    for path in FULL_TIER_PATHS:
        assert (ROOT / path).exists(), path
    for module, names in FULL_TIER_TESTS.items():
        source = (ROOT / module).read_text(encoding="utf-8")
        for name in names:
            assert re.search(rf"^(async )?def {name}\(", source, re.MULTILINE), f"{module}::{name}"
