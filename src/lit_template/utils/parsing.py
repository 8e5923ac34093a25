"""The one place numbers are read from config values and environment variables."""

from __future__ import annotations

import re
from typing import Any


def as_int(value: Any) -> int | None:
    """A whole number given as an int or a string of digits (``"-1"`` too); None for anything else, bools included."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def launcher_count(value: str | None) -> int | None:
    """A count a launcher exported: ``"8"`` -> 8, SLURM's ``"8(x2)"`` -> 8; anything else (``"0"`` included) -> None."""
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) or None if match else None
