"""Models by folder or by hub repo id: the id resolves to the HF cache's snapshot, with the
weights and tokenizer an OPT repo ships (`pytorch_model.bin`, vocab.json + merges.txt)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel

from replica.model_source import load_tokenizer, model_dir

ROOT = Path(__file__).resolve().parents[2]
MERGES = ["d e", "de f", "Ġ def"]


def _gpt2_tokenizer_files(folder: Path) -> None:
    """A byte-level BPE in the slow tokenizer's files, as OPT's repos ship it."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for merge in MERGES:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab["</s>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>", "unk_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _cache_opt_repo(hf_home: Path, repo: str, checkpoint: Path) -> None:
    """The HF cache's layout of a fetched OPT repo: `.bin` weights with a bare decoder's keys,
    no tokenizer.json."""
    owner, name = repo.split("/")
    entry = hf_home / "hub" / f"models--{owner}--{name}"
    snapshot = entry / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abcd")
    shutil.copy(checkpoint / "config.json", snapshot)
    from safetensors.torch import load_file

    state = load_file(str(checkpoint / "model.safetensors"))
    torch.save(
        {k.removeprefix("model."): v for k, v in state.items()}, snapshot / "pytorch_model.bin"
    )
    _gpt2_tokenizer_files(snapshot)


def test_a_folder_is_itself_and_a_missing_path_is_named(target_dir: Path) -> None:
    assert model_dir(target_dir) == target_dir
    assert model_dir(str(target_dir)) == target_dir
    with pytest.raises(
        ValueError, match=r"'deploy/models/nope' is not a folder .* nor a hub repo id"
    ):
        model_dir("deploy/models/nope")


def test_a_folder_without_tokenizer_json_gets_transformers_conversion(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None
    _gpt2_tokenizer_files(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer is not None
    encoded = tokenizer.encode("def def")
    assert encoded.tokens == ["def", "Ġdef"]
    assert tokenizer.decode(encoded.ids) == "def def"


def _run_offline(hf_home: Path, code: str) -> subprocess.CompletedProcess[str]:
    """huggingface_hub reads HF_HOME when it is imported, so the cache is a fresh process's."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_hub_id_loads_from_the_cache_into_engine_and_front_door(
    tmp_path: Path, opt_checkpoint: Callable[..., Path]
) -> None:
    """What a GPU node does with `model: facebook/opt-6.7b` once the repo is fetched: the engine
    loads the `.bin` weights, detokenizes, and the front door's codec encodes."""
    _cache_opt_repo(tmp_path / "hf", "facebook/opt-tiny", opt_checkpoint(tmp_path / "ckpt"))
    code = """
import json
from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine
from replica.model_source import model_dir
from replica.request import Request, SamplingParams, Tier
from router.tokenizer import TextCodec

engine = Engine.from_dirs("facebook/opt-tiny", num_blocks=8)
codec = TextCodec.from_dir("facebook/opt-tiny")
prompt = codec.encode("def def")
params = SamplingParams(max_tokens=4, ignore_eos=True)
engine.add_request(Request("a", prompt, params, tier=Tier.BEST_EFFORT))
engine.step(BatchPlan((PrefillChunk("a", len(prompt)),)))
while engine.finish_reason("a") is None:
    engine.step(BatchPlan((DecodeStep("a"),)))
print(json.dumps({"dir": str(model_dir("facebook/opt-tiny")), "prompt": prompt,
                  "opt": engine.target.config.is_opt, "out": engine.output_token_ids("a")}))
try:
    model_dir("facebook/opt-missing")
except ValueError as exc:
    print(exc)
"""
    done = _run_offline(tmp_path / "hf", code)
    assert done.returncode == 0, done.stderr
    first, error = done.stdout.strip().splitlines()
    result = json.loads(first)
    assert result["dir"].endswith("models--facebook--opt-tiny/snapshots/0123abcd")
    assert result["prompt"] == [257, 258] and result["opt"] and len(result["out"]) == 4
    assert "'facebook/opt-missing' is not a folder" in error
    assert "fetching the hub repo failed" in error
