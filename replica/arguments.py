"""argparse types shared by the `slos-serve` commands: a bad value is refused when the command
line is read, naming its option, rather than failing inside the run or, for an output path,
after it (a capacity search or a profile can take hours)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


class OptionError(ValueError):
    """A bad option or option combination found after parsing: `slos-serve` reports it as
    one `PROG: error:` line."""


def check_model_folders(*folders: tuple[str, Path | None]) -> None:
    """Each (option, folder) given holds a model (its config.json), else an OptionError naming
    the option, before anything loads: the defaults are the demo pair's folders, which exist
    once trained."""
    for option, path in folders:
        if path is not None and not (path / "config.json").is_file():
            raise OptionError(f"{option}: no model at {path} (train the pair: `make models`)")


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def _int_at_least(text: str, low: int) -> int:
    value = int(_number(text, int))
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def model_length(text: str) -> int:
    """A model's context in tokens: at least a prompt token and the token it is asked for."""
    return _int_at_least(text, 2)


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text!r}")
    return value


def unit_interval(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def unit_intervals(text: str) -> tuple[float, ...]:
    """A comma list of numbers in [0, 1] (repeats allowed)."""
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(
            f"needs numbers in [0, 1] separated by commas, got {text!r}"
        )
    return tuple(unit_interval(item) for item in items)


def output_file(text: str) -> Path:
    """A file the command will write: its folder exists and it can be opened for writing
    (tried now; a file that did not exist is removed again)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} does not exist")
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not existed:
        path.unlink()
    return path


def plot_file(text: str) -> Path:
    """An `output_file` for a figure, in a format matplotlib writes (its suffix, lower case;
    none: PNG): an unknown one would fail only when the figure is saved, after the run.
    matplotlib is imported here, when the option is given, so `--help` stays instant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(text).suffix.lower().removeprefix(".")
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: matplotlib writes no {suffix!r} files; use one of {', '.join(formats)}"
        )
    return output_file(text)


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value
