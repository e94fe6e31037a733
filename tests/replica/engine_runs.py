"""Running one request through an engine to its end, as the engine tests compare outputs,
and the decode function stop strings read."""

from __future__ import annotations

from pathlib import Path

from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Detokenize, Engine, detokenizer
from replica.model_source import load_tokenizer
from replica.request import Request


def load_detokenizer(folder: Path) -> Detokenize:
    """A model folder's decode function, as `Engine.from_dirs` makes it."""
    tokenizer = load_tokenizer(folder)
    assert tokenizer is not None
    return detokenizer(tokenizer)


def run(engine: Engine, request: Request, ks: list[int]) -> tuple[list[int], FinishReason | None]:
    """Prefill whole, then decode with speculation lengths cycling through `ks`; the engine
    must hold no KV afterwards."""
    rid = request.request_id
    engine.add_request(request)
    engine.step(BatchPlan((PrefillChunk(rid, request.prompt_len),)))
    step = 0
    while engine.finish_reason(rid) is None:
        engine.step(BatchPlan((DecodeStep(rid, ks[step % len(ks)]),)))
        step += 1
    out, reason = engine.output_token_ids(rid), engine.finish_reason(rid)
    engine.abort(rid)
    assert engine.num_free_blocks == engine.cache.num_blocks
    return out, reason
