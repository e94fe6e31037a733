"""Train the tiny demo models every slos-serve test and demo runs on: target, draft, reasoner.

No model hub is reachable from our machines, so the project ships its own real checkpoints.
The corpus is the Python standard library's own source (every machine has it); test folders,
codec tables and pydoc data are dropped because they are boilerplate that teaches nothing.
Files are split into train / held-out by a hash of their path so the split is stable.

The target is a small Llama; the draft is a narrow 3-layer Llama on the same tokenizer, first
trained on the corpus, then distilled on the target's own distribution (KL) over corpus windows,
then over the target's own continuations (greedy and sampled) of corpus prompts: speculative
decoding pays only when the draft agrees with the target on the text the target writes, not with
the data. The draft is narrow (hidden 128) because at batch 1 a step's cost follows its weight
bytes: the draft's are about a sixth of the target's.

The reasoner is the target taught to think first, as DeepSeek-R1 and Qwen3 do: asked for a
function by its signature, it writes `<think>`, the function's docstring, `</think>`, then the
body. The two markers are tokens of its own (its vocabulary is the pair's plus two, so it runs
without the draft), so a reasoning SLO's thinking stage can end on `</think>`.

Run with `make models`; deterministic for a seed; writes HF-format folders next to this file.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import math
import os
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EXCLUDED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "encodings",
    "pydoc_data",
    "site-packages",
    "__pycache__",
    "lib2to3",
}
HELDOUT_PERCENT = 5
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ModelShape:
    """Architecture of one member of the pair."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


TARGET = ModelShape(layers=6, hidden=256, intermediate=768, heads=8, kv_heads=4)
DRAFT = ModelShape(layers=3, hidden=128, intermediate=384, heads=4, kv_heads=2)
VOCAB = 4096
MAX_POSITIONS = 2048
THINK, END_THINK = "<think>", "</think>"
IGNORE = -100
"""A label the loss skips: the prompt and the padding of a reasoner example."""
REASONER_DOC_CHARS = 600
"""A docstring, cut here (about 150 tokens): thinking as long as a short answer, or longer."""
DRAFT_VOCAB = 2048
"""Tokens kept in the draft's LM head: the head is a third of a draft step's weight bytes, and
cut to the corpus's 2048 most frequent tokens it halves while greedy acceptance at k = 2 moves
from 0.597 to 0.588 (1024 tokens: 0.54)."""


def is_heldout(relpath: str) -> bool:
    """Stable file-level split: the same files are held out on every machine."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return digest[0] * 100 // 256 < HELDOUT_PERCENT


def corpus_files() -> list[tuple[str, Path]]:
    """Every .py file of the standard library outside the excluded folders, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((str(path.relative_to(root)), path))
    return found


def read_split() -> tuple[list[str], list[str]]:
    """Return (train texts, held-out texts)."""
    train: list[str] = []
    heldout: list[str] = []
    for rel, path in corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (heldout if is_heldout(rel) else train).append(text)
    return train, heldout


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One long token stream, documents separated by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def batches(stream: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    """Endless random windows of seq+1 tokens."""
    high = len(stream) - seq - 1
    while True:
        starts = torch.randint(0, high, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def seeded(seed: int) -> torch.Generator:
    """A fresh generator per phase, so each phase's data depends only on its own seed."""
    return torch.Generator().manual_seed(seed)


def row_batches(rows: torch.Tensor, batch: int, gen: torch.Generator):
    """Endless random batches of whole rows."""
    while True:
        yield rows[torch.randint(0, len(rows), (batch,), generator=gen)]


@torch.no_grad()
def target_continuations(
    target: LlamaForCausalLM,
    stream: torch.Tensor,
    count: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
) -> torch.Tensor:
    """[count, prompt_len + new_tokens] rows: corpus prompts continued by the target, half
    greedily (what greedy speculation verifies) and half sampled at temperature 0.8."""
    starts = torch.randint(0, len(stream) - prompt_len, (count,), generator=seeded(seed)).tolist()
    prompts = torch.stack([stream[s : s + prompt_len] for s in starts])
    rows = []
    chunk = 64
    for i in range(0, count, chunk):
        sampled = (i // chunk) % 2 == 1
        torch.manual_seed(seed + i)
        out = target.generate(
            prompts[i : i + chunk],
            attention_mask=torch.ones_like(prompts[i : i + chunk]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=sampled,
            temperature=0.8 if sampled else None,
            top_k=None,
            top_p=None,
            pad_token_id=target.config.pad_token_id,
        )
        rows.append(out)
        print(f"[continuations] {i + len(out)}/{count}")
    return torch.cat(rows)


def pca_embedding(weight: torch.Tensor, width: int) -> torch.Tensor:
    """The target's token embedding projected on its `width` principal directions: a narrower
    draft starts from the same token geometry instead of from noise."""
    centered = weight.float() - weight.float().mean(0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    projected = weight.float() @ v[:width].T
    return projected * (weight.float().std() / projected.std())


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq: int, windows: int) -> float:
    """Mean next-token cross-entropy (nats) over evenly spaced held-out windows."""
    model.eval()
    stride = max(1, (len(stream) - seq - 1) // windows)
    total = 0.0
    for i in range(windows):
        chunk = stream[i * stride : i * stride + seq + 1].unsqueeze(0)
        logits = model(chunk[:, :-1]).logits.float()
        total += F.cross_entropy(logits[0], chunk[0, 1:]).item()
    model.train()
    return total / windows


def train(
    model: LlamaForCausalLM,
    data: Iterator[torch.Tensor] | Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    lr: float,
    teacher: LlamaForCausalLM | None = None,
    label: str = "",
) -> float:
    """AdamW on next-token loss over `data` (batches of rows of seq + 1 tokens, or of
    (inputs, labels) with IGNORE where no loss is taken); with a teacher, on KL to the teacher
    plus a little CE."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        chunk = next(data)
        inputs, labels = chunk if isinstance(chunk, tuple) else (chunk[:, :-1], chunk[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs).logits.float()
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE
        )
        if teacher is None:
            loss = ce
        else:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                t_logits = teacher(inputs).logits.float()
            kl = (
                F.kl_div(
                    F.log_softmax(logits, -1),
                    F.log_softmax(t_logits, -1),
                    log_target=True,
                    reduction="batchmean",
                )
                / inputs.shape[1]
            )
            loss = kl + 0.1 * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            rate = (step + 1) * inputs.numel() / (time.time() - start)
            print(f"[{label}] step {step}/{steps} loss {loss.item():.3f} ({rate:.0f} tok/s)")
    model.eval()
    return time.time() - start


@torch.no_grad()
def greedy_agreement(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, stream: torch.Tensor, prompts: int, gen: int
) -> float:
    """Share of target-greedy positions where the draft's argmax equals the target's token.

    This is the acceptance rate of greedy speculative decoding for one proposed token.
    """
    stride = max(1, (len(stream) - 64) // prompts)
    hits = 0
    total = 0
    for i in range(prompts):
        prompt = stream[i * stride : i * stride + 32].unsqueeze(0)
        out = target.generate(
            prompt, max_new_tokens=gen, do_sample=False, pad_token_id=target.config.pad_token_id
        )
        t_next = target(out).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
        d_next = draft(out).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
        hits += int((t_next == d_next).sum())
        total += t_next.numel()
    return hits / total


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_draft_vocab(train_stream: torch.Tensor, out: Path, size: int = DRAFT_VOCAB) -> dict:
    """The draft head's vocabulary: the `size` most frequent training tokens (FR-Spec's cut).
    Speculation stays lossless: verification treats tokens off the cut as draft probability 0."""
    counts = torch.bincount(train_stream, minlength=VOCAB)
    ids = torch.argsort(counts, descending=True, stable=True)[:size]
    info = {
        "token_ids": sorted(ids.tolist()),
        "train_token_coverage": round(float(counts[ids].sum() / counts.sum()), 4),
        "source": "most frequent tokens of the demo pair's training split",
    }
    (out / "draft_vocab.json").write_text(json.dumps(info) + "\n")
    return info


def train_draft(
    target: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    stream: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[LlamaForCausalLM, float]:
    """Corpus next-token loss, then KL to the target on corpus windows, then KL to the target
    on the target's own continuations. Returns the draft and its training seconds."""
    draft = make_model(DRAFT, tokenizer)
    embedding = pca_embedding(target.model.embed_tokens.weight.data, DRAFT.hidden)
    draft.model.embed_tokens.weight.data.copy_(embedding)
    window = functools.partial(batches, stream, args.seq, args.batch)
    secs = train(draft, window(seeded(args.seed + 1)), args.draft_steps, 3e-3, None, "draft")
    secs += train(
        draft, window(seeded(args.seed + 2)), args.distill_steps, 1.5e-3, target, "distill"
    )
    began = time.time()
    prompt_len = args.seq + 1 - args.continuation_tokens
    rows = target_continuations(
        target, stream, args.continuations, prompt_len, args.continuation_tokens, args.seed + 3
    )
    secs += time.time() - began
    secs += train(
        draft,
        row_batches(rows, args.batch, seeded(args.seed + 4)),
        args.onpolicy_steps,
        1e-3,
        target,
        "on-policy",
    )
    return draft, secs


def draft_report(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    heldout: torch.Tensor,
    args: argparse.Namespace,
    secs: float,
) -> dict[str, Any]:
    return {
        **asdict(DRAFT),
        "params": sum(p.numel() for p in draft.parameters()),
        "steps": args.draft_steps,
        "distill_steps": args.distill_steps,
        "continuations": args.continuations,
        "continuation_tokens": args.continuation_tokens,
        "onpolicy_steps": args.onpolicy_steps,
        "train_seconds": round(secs, 1),
        "heldout_loss": round(heldout_loss(draft, heldout, args.seq, 64), 4),
        "greedy_agreement": round(greedy_agreement(target, draft, heldout, 24, 48), 4),
    }


def functions(texts: list[str]) -> list[tuple[str, str, str]]:
    """(signature, docstring on one line, body indented under the signature) of every
    function with a docstring and a body beyond it, file by file (each in `ast.walk`'s
    order)."""
    found: list[tuple[str, str, str]] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            thinking = " ".join(doc.split())[:REASONER_DOC_CHARS]
            signature = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].lineno - 1]))
            block = textwrap.dedent("\n".join(lines[node.body[1].lineno - 1 : node.end_lineno]))
            body = textwrap.indent(block, "    ")  # under the signature, as the file has it
            if thinking and signature.strip() and body.strip():
                found.append((signature.strip(), thinking, body.rstrip()))
    return found


def reasoner_tokenizer(target_dir: Path) -> PreTrainedTokenizerFast:
    """The pair's tokenizer with the two markers as tokens of their own (text, not special:
    they are part of the output a reasoning parser splits)."""
    reasoner = PreTrainedTokenizerFast.from_pretrained(target_dir)
    reasoner.add_tokens([THINK, END_THINK])
    return reasoner


def asking(tokenizer: PreTrainedTokenizerFast, signature: str) -> list[int]:
    """The chat prompt that asks the reasoner for a function by its signature."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": signature}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids


def reasoner_example(
    tokenizer: PreTrainedTokenizerFast, signature: str, doc: str, body: str, seq: int
) -> tuple[list[int], list[int]] | None:
    """(inputs, labels) of seq tokens: the chat prompt asking for the function, then its
    thinking and body with loss taken on them only; None when the thinking does not end in
    the window."""
    prompt_ids = asking(tokenizer, signature)
    answer = f"{THINK}{doc}{END_THINK}\n{body}\n"
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    answer_ids.append(tokenizer.eos_token_id)
    ids = (prompt_ids + answer_ids)[: seq + 1]
    end = tokenizer.convert_tokens_to_ids(END_THINK)
    if end not in ids[len(prompt_ids) :]:
        return None
    labels = [IGNORE] * (len(prompt_ids) - 1) + ids[len(prompt_ids) :]
    pad = seq + 1 - len(ids)
    return ids[:-1] + [tokenizer.pad_token_id] * pad, labels + [IGNORE] * pad


def reasoner_rows(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq: int) -> torch.Tensor:
    """Every function's example, as [examples, 2 (inputs, labels), seq]."""
    pairs = [reasoner_example(tokenizer, *f, seq) for f in functions(texts)]
    return torch.tensor([p for p in pairs if p is not None], dtype=torch.long)


def train_reasoner(
    train_texts: list[str], args: argparse.Namespace
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, int, float]:
    """The saved target, with rows for the two markers (their embeddings start at the mean
    token's), fine-tuned on the functions of the training split. Returns it, its tokenizer,
    the example count and the training seconds."""
    reasoner_tok = reasoner_tokenizer(args.out / "demo-target")
    reasoner = LlamaForCausalLM.from_pretrained(args.out / "demo-target", dtype=torch.float32)
    old = reasoner.get_input_embeddings().weight.shape[0]
    reasoner.resize_token_embeddings(len(reasoner_tok), mean_resizing=False)
    with torch.no_grad():
        weight = reasoner.get_input_embeddings().weight
        weight[old:] = weight[:old].mean(0)
    rows = reasoner_rows(reasoner_tok, train_texts, args.seq)
    print(f"[reasoner] {len(rows)} examples (functions whose thinking ends in the window)")
    batches = row_batches(rows, args.batch, seeded(args.seed + 5))
    data = (batch.unbind(1) for batch in batches)
    secs = train(reasoner, data, args.reasoner_steps, 1e-3, None, "reasoner")
    return reasoner, reasoner_tok, len(rows), secs


@torch.no_grad()
def thinks_then_answers(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, texts: list[str], count: int
) -> dict[str, float]:
    """Greedy outputs for the first `count` held-out signatures (up to 160 tokens): the share
    that think, end their thinking and answer after it (some text before EOS), and their mean
    thinking tokens."""
    think, end = tokenizer.convert_tokens_to_ids([THINK, END_THINK])
    done = ended = answered = thinking = 0
    for signature, _, _ in functions(texts)[:count]:
        ids = torch.tensor([asking(tokenizer, signature)])
        out = model.generate(
            ids, max_new_tokens=160, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )[0, ids.shape[1] :].tolist()
        done += out[:1] == [think]
        if end in out:
            at = out.index(end)
            ended += 1
            thinking += at + 1
            answer = tokenizer.decode(out[at + 1 :], skip_special_tokens=True)
            answered += bool(answer.strip())
    return {
        "heldout_signatures": count,
        "starts_thinking": round(done / count, 4),
        "ends_thinking": round(ended / count, 4),
        "answers_after": round(answered / count, 4),
        "mean_thinking_tokens": round(thinking / max(1, ended), 1),
    }


def make_reasoner(
    train_texts: list[str], heldout_texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Train and save demo-reasoner from the saved target; its report."""
    reasoner, reasoner_tok, examples, secs = train_reasoner(train_texts, args)
    save(reasoner, reasoner_tok, args.out / "demo-reasoner")
    return {
        "from": "demo-target",
        "vocab": len(reasoner_tok),
        "examples": examples,
        "steps": args.reasoner_steps,
        "train_seconds": round(secs, 1),
        **thinks_then_answers(reasoner, reasoner_tok, heldout_texts, 48),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=3000)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--distill-steps", type=int, default=1500)
    parser.add_argument("--continuations", type=int, default=1024)
    parser.add_argument("--continuation-tokens", type=int, default=160)
    parser.add_argument("--onpolicy-steps", type=int, default=1000)
    parser.add_argument("--reasoner-steps", type=int, default=800)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--draft-vocab-only",
        action="store_true",
        help="only (re)write demo-draft/draft_vocab.json from the shipped tokenizer",
    )
    parser.add_argument(
        "--draft-only",
        action="store_true",
        help="keep the shipped target and tokenizer; retrain the draft only",
    )
    parser.add_argument(
        "--reasoner-only",
        action="store_true",
        help="keep the shipped pair; retrain the reasoner only",
    )
    args = parser.parse_args()
    if args.draft_vocab_only:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "demo-target")
        stream = encode_stream(tokenizer, read_split()[0])
        info = write_draft_vocab(stream, args.out / "demo-draft")
        print(f"draft vocabulary: {DRAFT_VOCAB} tokens, {info['train_token_coverage']} coverage")
        return

    torch.manual_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    began = time.time()
    train_texts, heldout_texts = read_split()
    report_path = args.out / "training_report.json"
    if args.reasoner_only:
        report = json.loads(report_path.read_text())
        report["reasoner"] = make_reasoner(train_texts, heldout_texts, args)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["reasoner"], indent=2))
        return
    if args.draft_only:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "demo-target")
        target = LlamaForCausalLM.from_pretrained(args.out / "demo-target", dtype=torch.float32)
        target.eval()
        report = json.loads(report_path.read_text())
    else:
        tokenizer = train_tokenizer(train_texts)
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, heldout_texts)
    print(
        f"corpus: {len(train_texts)} train files ({len(train_stream)} tokens), "
        f"{len(heldout_texts)} held-out files ({len(heldout_stream)} tokens)"
    )
    if not args.draft_only:
        target = make_model(TARGET, tokenizer)
        windows = batches(train_stream, args.seq, args.batch, seeded(args.seed))
        t_secs = train(target, windows, args.target_steps, 3e-3, None, "target")
        report = {
            "corpus": "CPython standard library source (.py), excluding "
            + ", ".join(sorted(EXCLUDED_DIRS)),
            "python": sysconfig.get_python_version(),
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
            "vocab": len(tokenizer),
            "seq": args.seq,
            "batch": args.batch,
            "seed": args.seed,
            "target": {
                **asdict(TARGET),
                "params": sum(p.numel() for p in target.parameters()),
                "steps": args.target_steps,
                "train_seconds": round(t_secs, 1),
                "heldout_loss": round(heldout_loss(target, heldout_stream, args.seq, 64), 4),
            },
        }
        save(target, tokenizer, args.out / "demo-target")
    draft, d_secs = train_draft(target, tokenizer, train_stream, args)
    report["draft"] = draft_report(draft, target, heldout_stream, args, d_secs)
    report.pop("greedy_agreement", None)
    save(draft, tokenizer, args.out / "demo-draft")
    write_draft_vocab(train_stream, args.out / "demo-draft")
    if not args.draft_only:
        report["reasoner"] = make_reasoner(train_texts, heldout_texts, args)
        report["total_seconds"] = round(time.time() - began, 1)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
