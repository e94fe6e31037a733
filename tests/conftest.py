"""Shared fixtures: the shipped demo model pair and reasoner, a tiny OPT checkpoint, one local
Ray instance, and the `gpu` marker's skip rule."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"

# No model hub is reachable: every load must come from a local folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def demo_dir() -> Path:
    """The demo pair's folder; SLOS_DEMO_DIR overrides it (e.g. a retrained pair)."""
    override = os.environ.get("SLOS_DEMO_DIR")
    return Path(override) if override else ROOT / "deploy" / "models"


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return demo_dir() / "demo-target"


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    return demo_dir() / "demo-draft"


@pytest.fixture(scope="session")
def reasoner_dir() -> Path:
    return demo_dir() / "demo-reasoner"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _opt_checkpoint(path: Path, **overrides: object) -> Path:
    """A tiny randomly initialised OPT (learned positions, LayerNorms and projections with
    biases, a ReLU MLP, tied head), every bias and norm perturbed so that each one counts."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    fields: dict[str, object] = {
        "vocab_size": 300,
        "hidden_size": 64,
        "ffn_dim": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "word_embed_proj_dim": 64,
        "eos_token_id": 2,
    }
    config = OPTConfig(**{**fields, **overrides})
    model = OPTForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("bias") or "layer_norm" in name:
            torch.nn.init.normal_(param, mean=1.0 if name.endswith("weight") else 0.0, std=0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def opt_checkpoint() -> Callable[..., Path]:
    """Writes a tiny OPT checkpoint into a folder: `opt_checkpoint(path, **config_overrides)`."""
    return _opt_checkpoint


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray instance for every test that needs one (2 CPUs, 127.0.0.1), shut down at
    the end; a test run that already has Ray up keeps it."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
        )
    yield
    if started:
        ray.shutdown()
