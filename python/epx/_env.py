"""The environment switches the Python package reads (README.md, "Run-time settings"), parsed in one place. Nothing
here needs torch: epx.Config imports it on machines without torch too."""

from __future__ import annotations

import os


def switch(name: str, default: bool) -> bool:
    """An environment switch as every epx switch reads it: unset or empty gives default, 0 off, 1 on; anything else
    is a ValueError (a typo must not silently leave the default in place)."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got '{value}'")
    return default if value == "" else value == "1"
