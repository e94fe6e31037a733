"""Where a model's files come from: a local folder, or a Hugging Face Hub repo id.

The GPU deploy configs name their models by hub id (`facebook/opt-6.7b`); every process that
loads one (each replica, the front door's tokenizer) resolves it here to a folder in the HF
cache (`HF_HOME`), fetching on first use. Only what the engine reads is fetched: the configs,
the tokenizer files and the weights, safetensors when the repo has them, else its PyTorch
`.bin` shards (older repos such as OPT's have no safetensors).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`owner/name`, as the hub spells repo ids; a path with more parts is never one."""
REPLACEMENT_CHAR = "\ufffd"
"""What a tokenizer decodes a piece of a character to (byte-level tokens can split one)."""
CONFIG_FILES = ["*.json", "*.txt", "*.jinja", "*.model"]
"""config.json, generation_config.json, tokenizer files (merges.txt, tokenizer.model), and
the shard indexes."""


def model_dir(name: str | Path, *, weights: bool = True) -> Path:
    """The local folder holding `name`: the folder itself, or the hub repo's cached snapshot
    (without the weights when `weights` is False: the front door and the load generator need
    the tokenizer only)."""
    path = Path(name)
    if path.is_dir():
        return path
    text = str(name)
    if not HUB_ID.fullmatch(text):
        raise ValueError(f"model {text!r} is not a folder (from {Path.cwd()}) nor a hub repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        patterns = [*CONFIG_FILES, "*.safetensors"] if weights else CONFIG_FILES
        folder = Path(snapshot_download(text, allow_patterns=patterns))
        if weights and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(text, allow_patterns=["pytorch_model*.bin"]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ValueError(
            f"model {text!r} is not a folder (from {Path.cwd()}), and fetching the hub repo "
            f"failed: {exc}"
        ) from exc
    return folder


def model_folder(option: str, name: str | Path) -> Path:
    """`model_dir` without the weights (config and tokenizer fetched for a hub id), or an
    error naming the option or field that gave `name`."""
    try:
        return model_dir(name, weights=False)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def has_tokenizer(folder: Path) -> bool:
    """Whether `load_tokenizer` has files to build one from, without building it."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's `tokenizer.json`, else the fast tokenizer transformers converts from its
    older files (OPT ships vocab.json + merges.txt); None when it has neither."""
    if not has_tokenizer(folder):
        return None
    path = folder / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(folder))
    backend = getattr(converted, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"transformers built no fast tokenizer from the files in {folder}")
    return backend


def eos_token_ids(folder: Path, config: Mapping[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json (`config`) and generation_config.json (either may list
    several)."""
    ids: list[int] = []
    sources = [config]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)
