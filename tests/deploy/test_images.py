"""The container recipes agree with the project: Ray's official base image at the tested Ray
version, the pinned CPU torch, the GPU extra, and a build context that keeps what serving needs.

No Docker engine runs here, so these read the recipes; building them is a release step.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMAGES = {"Dockerfile": "cpu", "Dockerfile.cuda": "gpu"}


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "deploy" / name).read_text())
    lines = [line.strip() for line in text.splitlines()]
    pairs = [line.split(maxsplit=1) for line in lines if line and not line.startswith("#")]
    return [(p[0].upper(), p[1] if len(p) > 1 else "") for p in pairs]


def major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def torch_pin() -> str:
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    return pin


@pytest.mark.parametrize(("name", "flavour"), IMAGES.items())
def test_base_is_rays_official_image_at_the_tested_version(name: str, flavour: str) -> None:
    steps = instructions(name)
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    (base,) = [a for kind, a in steps if kind == "FROM"]
    python = PYPROJECT["project"]["requires-python"]
    assert "3.11" in python
    assert base == f"rayproject/ray:${{RAY_VERSION}}-py311-{flavour}"
    assert major_minor(args["RAY_VERSION"]) == major_minor(ray.__version__)


def test_cpu_image_installs_the_pinned_cpu_torch_before_the_project() -> None:
    runs = [a for kind, a in instructions("Dockerfile") if kind == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch" in r)
    project_step = next(i for i, r in enumerate(runs) if r.endswith(' ".[compile]"'))
    assert torch_step < project_step
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch_step]
    assert torch_pin() in runs[torch_step].split()


def test_gpu_image_installs_the_gpu_extra() -> None:
    runs = [a for kind, a in instructions("Dockerfile.cuda") if kind == "RUN"]
    assert any(torch_pin() in r.split() for r in runs)
    assert any(r.endswith('".[gpu,compile]"') for r in runs)
    assert any(
        d.startswith("flashinfer") for d in PYPROJECT["project"]["optional-dependencies"]["gpu"]
    )


@pytest.mark.parametrize("name", IMAGES)
def test_images_compile_the_planner_after_installing_mypyc(name: str) -> None:
    runs = [a for kind, a in instructions(name) if kind == "RUN"]
    install = next(i for i, r in enumerate(runs) if "compile]" in r)
    assert runs.index("slos-serve compile") > install
    assert any(
        d.startswith("mypy[mypyc]")
        for d in PYPROJECT["project"]["optional-dependencies"]["compile"]
    )


@pytest.mark.parametrize("name", IMAGES)
def test_workdir_is_where_the_configs_relative_paths_resolve(name: str) -> None:
    steps = instructions(name)
    assert ("WORKDIR", "/home/ray/slos-serve") in steps
    assert ("COPY", "--chown=ray:users . .") in steps


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `path` (itself or one of its parent folders)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pattern)
        or fnmatch.fnmatch(prefix.split("/")[-1], pattern.removeprefix("**/"))
        for pattern in patterns
        for prefix in prefixes
    )


def test_dockerignore_keeps_what_serving_needs_and_drops_the_rest() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in [
        "pyproject.toml",
        "README.md",
        "cluster/config.py",
        "replica/engine.py",
        "router/app.py",
        "loadgen/cli.py",
        "deploy/serve-cpu.yaml",
        "deploy/models/demo-target/config.json",
        "deploy/profiles/cpu-demo.json",
    ]:
        assert not ignored(needed, patterns), needed
    for dropped in [
        ".venv/bin/python",
        ".git/HEAD",
        "replica/__pycache__/x.pyc",
        "tests/conftest.py",
    ]:
        assert ignored(dropped, patterns), dropped
