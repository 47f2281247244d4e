"""docs/settings.md is what `python -m app.settings_doc` prints from the Settings class."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from app.settings_doc import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_settings_page_is_generated_from_the_settings_class() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/settings.md differs from the Settings class: run `make docs` "
        "(python -m app.settings_doc > docs/settings.md)"
    )


def test_the_page_names_every_setting_with_its_variable_and_flag() -> None:
    page = render()
    for name in Settings.model_fields:
        row = f"| `{name}` | `EMBED_{name.upper()}`, `--{name.replace('_', '-')}"
        assert row in page, name
