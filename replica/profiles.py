"""Perf profiles by name: the shipped ones in deploy/profiles, a deploy config's short name, or
a path; every command that plans with a profile (simulate, loadgen, the benches, demo) takes
them the same way."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from replica.arguments import OptionError
from replica.perf_model import PerfModel

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROFILES = DEPLOY / "profiles"
CPU_PROFILE = "cpu-demo"
"""The shipped profile of the CPU demo pair: the default wherever it is served or planned."""


def profile_aliases() -> dict[str, str]:
    """Short names: each deploy config's, `serve-<name>.yaml`, for the profile it serves with
    (`a100-opt7b` is the paper's setup), read from the configs themselves."""
    aliases = {}
    for config in sorted(DEPLOY.glob("serve-*.yaml")):
        (app,) = yaml.safe_load(config.read_text())["applications"]
        aliases[config.stem.removeprefix("serve-")] = Path(app["args"]["cluster"]["profile"]).stem
    return aliases


def resolve_profile(name: str) -> Path:
    """A profile path, a name in deploy/profiles (with or without .json) or a deploy config's
    short name (`profile_aliases`)."""
    path = Path(name)
    if path.is_file():
        return path
    stem = name.removesuffix(".json")
    shipped = PROFILES / f"{stem}.json"
    if shipped.is_file():
        return shipped
    aliases = profile_aliases()
    if stem in aliases:
        return PROFILES / f"{aliases[stem]}.json"
    known = sorted(p.stem for p in PROFILES.glob("*.json")) + sorted(aliases)
    close = difflib.get_close_matches(stem, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"profile {name!r} is neither a file nor one of {known}{hint}")


def load_profile(option: str, name: str) -> PerfModel:
    """The profile a name or path gives, or an error naming `option`."""
    try:
        return PerfModel.load(resolve_profile(name))
    except ValueError as exc:
        raise OptionError(f"{option}: {exc}") from None
