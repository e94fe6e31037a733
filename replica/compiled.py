"""The planner and the perf model compiled to C by mypyc: the same source, run faster.

The live controller and the simulator spend their time in the planner's pure-Python loops, a
few microseconds at a time with nothing for numpy to vectorize. mypyc compiles the typed
modules in `MODULES`. `slos-serve compile` (`make compile`) builds them into
the per-user cache under a key hashed from their sources; `use()`, run when `replica` is first
imported, points imports of those modules at that build only while every source still hashes
to its key. So an edited module never runs stale code: the process runs the Python source until
the next build. Without a build, or with SLOS_SERVE_COMPILED=0, everything runs from source.
The cache keeps the builds made or asked for last (`KEEP_BUILDS`).

Compiled code is stricter than Python in three ways the sources allow for:
- A frozen dataclass compiled by mypyc cannot be unpickled or copied the usual way, so the
  ones that outlive a planning call (held by a scheduler, pickled to Ray actors and worker
  processes) rebuild themselves through their constructor (`reduce_frozen`). Schedulers
  themselves are not copied: a compiled class's copy would run its constructor again.
- A Python class cannot subclass a compiled one unless it allows it: `Scheduler` does, so the
  baselines and policies written in Python can implement it.
- A value read as a declared `int` or `float` is converted on the way (a bool becomes 1), so
  checks of user input live in modules left as Python (`perf_info`, `planner/config`, the
  baselines, `request`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from replica.user_cache import user_cache_dir

MODULES = (
    "replica.perf_model",
    "replica.planner.admission",
    "replica.planner.base",
    "replica.planner.batching",
    "replica.planner.budget",
    "replica.planner.deadlines",
    "replica.planner.executor",
    "replica.planner.goodspeed",
    "replica.planner.laps",
    "replica.planner.queues",
    "replica.planner.slos",
    "replica.planner.specserve",
)
GROUP = "replica.planner_c"
"""mypyc's group name: the code of all of `MODULES` is one library, `replica.planner_c__mypyc`,
so they call each other natively; each module's own extension is a shim onto it."""
DISABLE_ENV = "SLOS_SERVE_COMPILED"
KEEP_BUILDS = 4
"""Builds kept in the cache (about 2.3 MB each): a few checkouts or branches side by side."""
ROOT = Path(__file__).resolve().parent.parent
_DONE = "complete"
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def source_path(root: Path, module: str) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def source_key(root: Path = ROOT) -> str:
    """Hash of what a build is made from: the modules' names and sources and the interpreter."""
    digest = hashlib.sha256(f"{GROUP}\0{sys.version}\0{_SUFFIX}".encode())
    for module in MODULES:
        digest.update(f"\0{module}\0".encode())
        digest.update(source_path(root, module).read_bytes())
    return digest.hexdigest()[:20]


def build_dir(key: str) -> Path:
    return user_cache_dir() / "mypyc" / key


class _BuildFinder(MetaPathFinder):
    """Finds the compiled modules (and their shared library) in one build directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.names = {*MODULES, f"{GROUP}__mypyc"}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.names:
            return None
        *package, name = fullname.split(".")
        file = self.directory.joinpath(*package, name + _SUFFIX)
        return importlib.util.spec_from_file_location(fullname, file)


def use() -> None:
    """Load `MODULES` from the build of their current sources, if there is one. Must run
    before any of them is imported: `replica/__init__` calls it, once per process."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return
    directory = build_dir(source_key())
    if (directory / _DONE).exists():
        sys.meta_path.insert(0, _BuildFinder(directory))


def active() -> bool:
    """Whether this process runs the compiled planner."""
    from replica.planner import slos

    return (slos.__file__ or "").endswith(_SUFFIX)


def build(root: Path = ROOT) -> Path:
    """The cache's build of `MODULES` as they are in `root`, compiled unless it exists."""
    target = build_dir(source_key(root))
    if not (target / _DONE).exists():
        _compile(root, target)
    (target / _DONE).touch()
    prune(target.parent)
    return target


def _compile(root: Path, target: Path) -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        # mypyc type-checks first: from a checkout's root with the project's [tool.mypy]
        # settings; in an installed copy (site-packages, no settings) it must not ask for
        # stubs of packages that ship none.
        with contextlib.chdir(root):
            extensions = mypycify(
                [
                    "--ignore-missing-imports",
                    *(str(source_path(root, m).relative_to(root)) for m in MODULES),
                ],
                group_name=GROUP,
                target_dir=str(work / "c"),
            )
            dist = Distribution({"name": "slos-serve-planner", "ext_modules": extensions})
            command = dist.get_command_obj("build_ext")
            command.build_lib = str(work / "lib")
            command.build_temp = str(work / "obj")
            dist.run_command("build_ext")
        (work / "lib" / _DONE).touch()
        # Renamed into place whole, so a concurrent reader never sees half a build (a
        # concurrent builder's rename may win; the check below accepts either).
        with contextlib.suppress(OSError):
            os.replace(work / "lib", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not (target / _DONE).exists():
        raise RuntimeError(f"mypyc build of the planner did not land in {target}")


def prune(builds: Path, keep: int = KEEP_BUILDS) -> None:
    """Remove all but the `keep` builds built or asked for last: every edit of a compiled
    source makes a new one. A process still running a removed build keeps its mapped copy."""
    done = [d / _DONE for d in builds.iterdir() if (d / _DONE).exists()]
    done.sort(key=lambda marker: marker.stat().st_mtime, reverse=True)
    for marker in done[keep:]:
        shutil.rmtree(marker.parent, ignore_errors=True)


def reduce_frozen(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """`__reduce__` for a frozen dataclass mypyc compiles: copy and pickle rebuild it through
    its constructor, because mypyc's own unpickling sets fields one by one and a frozen class
    refuses that."""
    return type(obj), tuple(getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compile the planner and the perf model with mypyc into the user's cache; every later "
        "process loads that build while the sources are unchanged (SLOS_SERVE_COMPILED=0: "
        "run from source)."
    )


def run(args: argparse.Namespace) -> int:
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        print(f"no C compiler ({compiler}): the planner runs from its Python source")
        return 0
    print(f"compiled planner: {build()}")
    return 0
