"""JSON text as the standard defines it: Python's parser also takes NaN and Infinity, which
no other JSON reader does, so a body or a schema holding them is refused."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """`json.loads` without NaN and Infinity (a ValueError, as for any other bad JSON)."""
    return json.loads(text, parse_constant=_refuse)


def _refuse(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_refuse)
"""For `raw_decode`: reading one value after another out of a text, with `loads`'s rules."""
