"""Our forward pass against transformers' on the demo target, over the paged cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replica.kv_cache import KVCacheManager
from replica.model_runner import BLOCK_SIZE, ForwardSeq, KVMove, ModelConfig, ModelRunner

TOL = 1e-4


@pytest.fixture(scope="module")
def runner(target_dir: Path) -> ModelRunner:
    return ModelRunner(target_dir, num_blocks=32)


@pytest.fixture(scope="module")
def hf_logits(target_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


PROMPT = [(i * 37 + 11) % 4000 + 2 for i in range(40)]


def test_config_reads_llama_fields(runner: ModelRunner) -> None:
    cfg = runner.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 32)
    assert cfg.tie_word_embeddings
    assert cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == (0,)


def test_chunked_prefill_matches_transformers(runner: ModelRunner, hf_logits: torch.Tensor) -> None:
    cache = KVCacheManager(runner.num_blocks)
    rows = []
    done = 0
    for n in (1, 16, 7, 16):
        cache.append("a", n)
        seq = ForwardSeq(PROMPT[done : done + n], cache.block_table("a"), done, num_logits=n)
        rows.append(runner.forward([seq]))
        done += n
    assert torch.allclose(torch.cat(rows), hf_logits, atol=TOL)


def test_ragged_batch_matches_separate_runs(runner: ModelRunner, hf_logits: torch.Tensor) -> None:
    cache = KVCacheManager(runner.num_blocks)
    cache.append("a", 30)
    runner.forward([ForwardSeq(PROMPT[:30], cache.block_table("a"), 0)])
    cache.append("a", 3)
    cache.append("b", 12)
    cache.append("c", 1)
    out = runner.forward(
        [
            ForwardSeq(PROMPT[30:33], cache.block_table("a"), 30, num_logits=3),
            ForwardSeq(PROMPT[:12], cache.block_table("b"), 0, num_logits=2),
            ForwardSeq(PROMPT[:1], cache.block_table("c"), 0, num_logits=1),
        ]
    )
    expected = torch.cat([hf_logits[30:33], hf_logits[10:12], hf_logits[:1]])
    assert torch.allclose(out, expected, atol=TOL)


def test_explicit_mask_and_positions_express_a_token_tree(runner: ModelRunner) -> None:
    """Two sibling branches after a shared context: each sees the context and itself only,
    both at the same position, exactly as if each were fed alone."""
    cache = KVCacheManager(runner.num_blocks)
    ctx = PROMPT[:20]
    cache.append("t", 22)
    runner.forward([ForwardSeq(ctx, cache.block_table("t"), 0)])
    mask = torch.eye(2, dtype=torch.bool)
    tree = runner.forward(
        [ForwardSeq([5, 9], cache.block_table("t"), 20, 2, positions=[20, 20], attn_mask=mask)]
    )
    for i, token in enumerate((5, 9)):
        alone = KVCacheManager(runner.num_blocks)
        alone.append("x", 21)
        expected = runner.forward([ForwardSeq([*ctx, token], alone.block_table("x"), 0, 1)])
        assert torch.allclose(tree[i], expected[0], atol=TOL)


def test_a_wide_mask_hides_cached_cousins_and_moved_kv_reads_as_fed(runner: ModelRunner) -> None:
    """A tree grown over two forwards: level 1 (two siblings) is cached when level 2 is fed,
    and a [q, num_cached + q] mask keeps the second sibling's child from seeing the first
    sibling. Moving that branch to the positions after the context then reads exactly as if
    the branch had been fed there in order."""
    cache = KVCacheManager(runner.num_blocks)
    ctx = PROMPT[:20]
    cache.append("t", 23)
    table = cache.block_table("t")
    runner.forward([ForwardSeq(ctx, table, 0)])
    runner.forward(
        [ForwardSeq([5, 9], table, 20, 0, positions=[20, 20], attn_mask=torch.eye(2).bool())]
    )
    wide = torch.ones(1, 23, dtype=torch.bool)
    wide[0, 20] = False
    child = runner.forward([ForwardSeq([7], table, 22, 1, positions=[21], attn_mask=wide)])
    cache.append("x", 23)
    in_order = runner.forward([ForwardSeq([*ctx, 9, 7, 3], cache.block_table("x"), 0, 2)])
    assert torch.allclose(child[0], in_order[0], atol=TOL)
    runner.move_kv([KVMove(table, src=[21, 22], dst=[20, 21])])
    after = runner.forward([ForwardSeq([3], table, 22, 1)])
    assert torch.allclose(after[0], in_order[1], atol=TOL)
    with pytest.raises(ValueError, match="outside the request's blocks"):
        runner.move_kv([KVMove(table, src=[len(table) * BLOCK_SIZE], dst=[0])])
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        runner.forward([ForwardSeq([7], table, 22, 1, attn_mask=torch.ones(1, 5).bool())])


def test_mixed_batch_matches_each_request_alone(runner: ModelRunner) -> None:
    """Decodes, a verify tree and prefill chunks (longer than SMALL_QUERY, so the CPU path splits
    them into separate attention calls, two equal fresh chunks sharing one) interleaved in one
    batch give the logits each request gets alone."""
    cache = KVCacheManager(runner.num_blocks)
    contexts = {"dec30": 30, "chunk": 20, "dec10": 10, "fresh": 0, "tree": 20, "fresh2": 0}
    for rid, n in contexts.items():
        if n:
            cache.append(rid, n)
            runner.forward([ForwardSeq(PROMPT[:n], cache.block_table(rid), 0)])
    steps = {
        "dec30": (PROMPT[30:31], None, None),
        "chunk": (PROMPT[20:40], None, None),
        "dec10": (PROMPT[10:11], None, None),
        "fresh": (PROMPT[:24], None, None),
        "tree": ([5, 9, 7], [20, 20, 21], torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]]).bool()),
        "fresh2": (PROMPT[5:29], None, None),
    }
    batch = []
    for rid, (tokens, positions, mask) in steps.items():
        cache.append(rid, len(tokens))
        table = cache.block_table(rid)
        batch.append(ForwardSeq(tokens, table, contexts[rid], len(tokens), positions, mask))
    alone = torch.cat([runner.forward([seq]) for seq in batch])
    mixed = runner.forward(batch)
    assert torch.allclose(mixed, alone, atol=TOL)


def test_kv_budget_in_bytes_sizes_the_pool(target_dir: Path) -> None:
    cfg = ModelConfig.from_dir(target_dir)
    per_block = cfg.kv_bytes_per_block(torch.float32)
    assert per_block == cfg.num_layers * 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 4
    runner = ModelRunner(target_dir, kv_memory_bytes=10 * per_block + 1)
    assert runner.num_blocks == 10
    with pytest.raises(ValueError, match="exactly one"):
        ModelRunner(target_dir, num_blocks=4, kv_memory_bytes=1 << 20)


def test_bad_batches_are_refused(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward([ForwardSeq(PROMPT[:20], [0], 0)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.forward([ForwardSeq([runner.vocab_size], [0], 0)])
    with pytest.raises(ValueError, match="num_logits"):
        runner.forward([ForwardSeq([3], [0], 0, num_logits=2)])


def test_bfloat16_stays_close_to_float32(target_dir: Path, hf_logits: torch.Tensor) -> None:
    runner = ModelRunner(target_dir, num_blocks=8, dtype=torch.bfloat16)
    cache = KVCacheManager(runner.num_blocks)
    cache.append("a", len(PROMPT))
    out = runner.forward([ForwardSeq(PROMPT, cache.block_table("a"), 0, len(PROMPT))])
    agree = (out.argmax(-1) == hf_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.gpu
def test_flashinfer_path_matches_cpu(target_dir: Path, hf_logits: torch.Tensor) -> None:
    runner = ModelRunner(target_dir, num_blocks=8, device="cuda")
    cache = KVCacheManager(runner.num_blocks)
    cache.append("a", len(PROMPT))
    out = runner.forward([ForwardSeq(PROMPT, cache.block_table("a"), 0, len(PROMPT))])
    assert torch.allclose(out.cpu(), hf_logits, atol=1e-2)


@pytest.mark.gpu
def test_a_kv_pool_larger_than_the_gpu_is_refused_with_its_size(target_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"KV blocks need .* lower num_kv_blocks"):
        ModelRunner(target_dir, num_blocks=10**9, device="cuda")


@pytest.mark.gpu
def test_a_cuda_engine_serves_the_cpu_engines_greedy_tokens(
    target_dir: Path, draft_dir: Path
) -> None:
    """The replica's GPU path end to end: the pair on CUDA, speculating, greedy tokens as on
    the CPU; a seeded sampled request runs too (its generator stays on the CPU)."""
    from replica.batch import BatchPlan, DecodeStep, PrefillChunk
    from replica.engine import Engine
    from replica.request import Request, SamplingParams, Tier

    def run(device: str, params: SamplingParams) -> list[int]:
        engine = Engine.from_dirs(target_dir, draft_dir, num_blocks=16, device=device)
        engine.add_request(Request("a", PROMPT[:20], params, tier=Tier.BEST_EFFORT))
        engine.step(BatchPlan((PrefillChunk("a", 20),)))
        while engine.finish_reason("a") is None:
            engine.step(BatchPlan((DecodeStep("a", num_spec_tokens=3),)))
        return engine.output_token_ids("a")

    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    assert run("cuda", greedy) == run("cpu", greedy)
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)
    assert len(run("cuda", sampled)) == 12


def test_a_cut_head_returns_the_full_heads_columns(runner: ModelRunner, target_dir: Path) -> None:
    vocab = [0, 5, 17, 4095, 300]
    cut = ModelRunner(target_dir, num_blocks=32, head_vocab=vocab)
    seq = [ForwardSeq(PROMPT[:20], list(range(2)), 0, num_logits=3)]
    assert torch.allclose(cut.forward(seq), runner.forward(seq)[:, vocab], atol=TOL)
    for bad in ([], [1, 1], [4096]):
        with pytest.raises(ValueError, match="head_vocab"):
            ModelRunner(target_dir, num_blocks=2, head_vocab=bad)


SMALL_PROMPT = [(i * 7 + 3) % 290 + 5 for i in range(37)]
"""Token ids inside the tiny random checkpoints' 300-token vocabulary."""


def _chunked_rows(runner: ModelRunner) -> torch.Tensor:
    """SMALL_PROMPT as a prefill chunk, then a decode row, a verify-sized row and the rest,
    over the pool (the fused C forward takes the small rows when it is built)."""
    cache = KVCacheManager(runner.num_blocks)
    rows = []
    for start, stop in ((0, 30), (30, 31), (31, 35), (35, 37)):
        cache.append("a", stop - start)
        seq = ForwardSeq(SMALL_PROMPT[start:stop], cache.block_table("a"), start, stop - start)
        rows.append(runner.forward([seq]))
    return torch.cat(rows)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised Qwen2 checkpoint (biased QKV, untied head, GQA)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    model = Qwen2ForCausalLM(config)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pytorch"])
def test_qwen2_matches_transformers(qwen2_dir: Path, fused: bool) -> None:
    """A prefill chunk, then decode and verify rows (the fused C forward when it is built)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([SMALL_PROMPT])).logits[0]
    runner = ModelRunner(qwen2_dir, num_blocks=8, fused_forward=fused)
    assert runner.config.qkv_bias and not runner.config.tie_word_embeddings
    assert torch.allclose(_chunked_rows(runner), want, atol=TOL)


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory: pytest.TempPathFactory, opt_checkpoint: Callable[..., Path]) -> Path:
    return opt_checkpoint(tmp_path_factory.mktemp("opt"))


def test_opt_matches_transformers(opt_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(opt_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([SMALL_PROMPT])).logits[0]
    runner = ModelRunner(opt_dir, num_blocks=8)
    assert runner.config.is_opt and runner.config.tie_word_embeddings
    assert runner.config.eos_token_ids == (2,)
    assert torch.allclose(_chunked_rows(runner), want, atol=TOL)


def test_opt_bin_checkpoint_of_a_bare_decoder_loads_the_same(opt_dir: Path, tmp_path: Path) -> None:
    """Older hub checkpoints (OPT's among them) ship `pytorch_model.bin` with `decoder.*` keys."""
    from safetensors.torch import load_file

    state = load_file(str(opt_dir / "model.safetensors"))
    bare = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    torch.save(bare, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((opt_dir / "config.json").read_text())
    from_bin = _chunked_rows(ModelRunner(tmp_path, num_blocks=8))
    assert torch.equal(from_bin, _chunked_rows(ModelRunner(opt_dir, num_blocks=8)))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"do_layer_norm_before": False}, "do_layer_norm_before"),
        ({"activation_function": "gelu"}, "activation_function"),
    ],
)
def test_opt_variants_we_do_not_compute_are_refused(
    tmp_path: Path, opt_checkpoint: Callable[..., Path], overrides: dict[str, object], field: str
) -> None:
    path = opt_checkpoint(tmp_path, **overrides)
    with pytest.raises(ValueError, match=f"OPT with {field}="):
        ModelRunner(path, num_blocks=8)


def test_an_opt_pair_speculates_to_transformers_greedy_output(
    opt_dir: Path, tmp_path: Path, opt_checkpoint: Callable[..., Path]
) -> None:
    """OPT-6.7B with OPT-125m is the paper's pair: the engine drafts with one OPT and verifies
    with another, and its greedy tokens are transformers' own."""
    from transformers import AutoModelForCausalLM

    from replica.batch import BatchPlan, DecodeStep, PrefillChunk
    from replica.engine import Engine
    from replica.request import Request, SamplingParams, Tier

    draft_dir = opt_checkpoint(tmp_path, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(opt_dir, dtype=torch.float32).eval()
    prompt = SMALL_PROMPT[:20]
    want = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12
    )[0, len(prompt) :].tolist()
    engine = Engine.from_dirs(opt_dir, draft_dir, num_blocks=16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request(Request("a", prompt, params, tier=Tier.BEST_EFFORT))
    engine.step(BatchPlan((PrefillChunk("a", len(prompt)),)))
    while engine.finish_reason("a") is None:
        engine.step(BatchPlan((DecodeStep("a", num_spec_tokens=3),)))
    assert engine.output_token_ids("a") == want
