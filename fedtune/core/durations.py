"""Durations as the config writes them (federation.wait, federation.transfer_timeout): 3600, "90m", "3d"."""

from __future__ import annotations

import re

from fedtune.core.options import ConfigError

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value, key: str) -> float:
    """Seconds of a duration as the config writes it: 3600, "90m", "3d"."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", str(value))
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"{key}: {value!r} is no duration (a number of seconds, or with unit s, m, h, d: '3d')"
        )
    return float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]
