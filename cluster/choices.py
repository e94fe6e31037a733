"""Config values that must be one of an enum's members."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

E = TypeVar("E", bound=StrEnum)


def member(kind: type[E], name: str, value: Any) -> E:
    """`value` as a member of `kind`, or a ValueError naming the field and the members."""
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(m.value for m in kind)
        raise ValueError(f"{name} must be one of {known}, got {value!r}") from None
