"""The OpenAI-compatible HTTP door: a FastAPI app over a `FrontDoor`.

Plain FastAPI, so it runs under Ray Serve (router.app) and under any ASGI server alike.
The body is read as raw JSON and validated by `router.openai_schema`, never by FastAPI models,
so every bad body gets the same OpenAI error JSON with the field named, and never a 422 or 500.
Streams are SSE in OpenAI's chunk format; the status (200, 429, 503) is decided before the
first byte, from the cluster's first answer, which also gives the `x-slos-serve-*` headers
(verdict, replica, hops) a stream carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from replica.batch import TokenLogprob
from router import json_text
from router.errors import (
    ApiError,
    BadRequest,
    ClientGone,
    InternalError,
    ModelNotFound,
    NoRoute,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from router.frontdoor import Finished, FrontDoor, Generation, TextDelta, interleaved
from router.openai_format import (
    ChunkWriter,
    Spelling,
    TokenIds,
    cluster_headers,
    error_body,
    full_response,
    placement_headers,
)
from router.openai_schema import Endpoint, ParsedRequest, parse_detokenize, parse_tokenize


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if isinstance(error, Unauthorized):  # RFC 6750: the scheme the server wants
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def create_app(door: FrontDoor) -> FastAPI:
    app = FastAPI(title="slos-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def on_fault(_: Request, exc: Exception) -> JSONResponse:
        """A fault of ours answers the error JSON too, not Starlette's plain text (which
        logs the fault)."""
        return error_response(InternalError.of(exc))

    @app.exception_handler(HTTPException)
    async def on_routing_error(request: Request, exc: HTTPException) -> Response:
        """Routing's 404 and 405 in the error JSON of every other error, not FastAPI's
        {"detail": ...}; a 405 keeps its Allow header. Any other status is Starlette's."""
        if exc.status_code not in (404, 405):
            return await http_exception_handler(request, exc)
        where = f"{exc.detail}: {request.method} {request.url.path}"
        error = NoRoute(where, status=exc.status_code)
        return JSONResponse(error_body(error), status_code=error.status, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(door, request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(door, request, Endpoint.CHAT)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        door.authenticate(request.headers.get("authorization"))
        tokens = parse_tokenize(await _json(request, door), door.schema, door.codec)
        limit = door.schema.max_model_len
        return JSONResponse({"count": len(tokens), "max_model_len": limit, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        door.authenticate(request.headers.get("authorization"))
        tokens = parse_detokenize(await _json(request, door), door.schema)
        return JSONResponse({"prompt": door.codec.decode(tokens, skip_special_tokens=False)})

    def model_card() -> dict[str, object]:
        return {
            "id": door.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "slos-serve",
            "max_model_len": door.schema.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        door.authenticate(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        door.authenticate(request.headers.get("authorization"))
        if model_id != door.model_name:
            raise ModelNotFound(f"model {model_id!r} does not exist", "model")
        return JSONResponse(model_card())

    @app.get("/v1/cluster/status")
    async def cluster_status(request: Request) -> JSONResponse:
        door.authenticate(request.headers.get("authorization"))
        return JSONResponse(dataclasses.asdict(await door.status()))

    @app.get("/health")
    async def health() -> JSONResponse:
        status = await door.status()
        alive = sum(r.alive for r in status.replicas)
        if not alive:
            raise Unavailable("no replica is up")
        return JSONResponse({"status": "ok", "replicas_alive": alive})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await door.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _json(request: Request, door: FrontDoor) -> object:
    """The body as JSON that holds only text a tokenizer takes."""
    raw = await _body(request, door.schema.max_request_bytes)
    try:
        body = json_text.loads(raw)
        # JSON may escape a lone UTF-16 surrogate ("\ud800"); no tokenizer takes one.
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise BadRequest(
            "the request body holds a lone UTF-16 surrogate, which is not text"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {_why_not_json(exc)}") from None
    return body


async def _body(request: Request, limit: int) -> bytes:
    """The body, read only while it stays within `limit` bytes (a declared length above it is
    refused before anything is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {declared} bytes; at most {limit} are read")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the request body has more than {limit} bytes, the most read")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("the client left before it sent the whole body") from None
    return b"".join(chunks)


def _why_not_json(exc: ValueError | RecursionError) -> str:
    if isinstance(exc, RecursionError):
        return "it nests too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    if "integer string conversion" in str(exc):
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return str(exc)  # json_text's NaN and Infinity


async def _generate(door: FrontDoor, request: Request, endpoint: Endpoint) -> Response:
    tenant = door.authenticate(request.headers.get("authorization"))
    try:
        body = await _json(request, door)
    except BadRequest:
        door.metrics.reject(tenant, "bad_request")
        raise
    parsed = door.parse(endpoint, body, request.headers, tenant)
    generations = await door.start(parsed, tenant)
    if parsed.stream:
        placements = [g.placement for g in generations]
        return StreamingResponse(
            _sse(generations, parsed, door),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **placement_headers(placements)},
        )
    collecting = [asyncio.ensure_future(g.collect()) for g in generations]
    try:
        outputs = await asyncio.gather(*collecting)
    except ApiError:  # one choice failed: the others are given up, not left by the client
        for generation in generations:
            generation.close(lost=True)
        raise
    finally:  # a cancelled collect aborts its request (the client left, or is told it failed)
        for task in collecting:
            task.cancel()
    created = int(parsed.arrival_time)
    content = full_response(
        endpoint,
        parsed.response_id,
        created,
        door.model_name,
        outputs,
        parsed.n,
        _spelling(parsed, door),
        parsed.echo,
        parsed.tools,
        [r.prompt_token_ids for r in parsed.requests] if parsed.prompt_logprobs else [],
        parsed.reasoning,
    )
    return JSONResponse(content, headers=cluster_headers(content["slos_serve"]))


def _spelling(parsed: ParsedRequest, door: FrontDoor) -> Spelling:
    return TokenIds() if parsed.tokens_as_ids else door.codec


async def _sse(
    generations: tuple[Generation, ...], parsed: ParsedRequest, door: FrontDoor
) -> AsyncIterator[bytes]:
    created = int(parsed.arrival_time)
    writer = ChunkWriter(
        parsed.endpoint,
        parsed.response_id,
        created,
        door.model_name,
        _spelling(parsed, door),
        parsed.tools,
        parsed.reasoning,
    )
    finished: dict[int, Finished] = {}
    echoes = dict(enumerate(parsed.echo))
    failed = False
    try:
        async with contextlib.aclosing(interleaved(generations)) as events:
            async for index, event in events:
                if index in echoes:  # the prompt leads the choice's first chunk
                    echo = echoes.pop(index)
                    prompt: list[TokenLogprob | None] = []
                    if isinstance(event, TextDelta) and echo.logprobs:
                        prompt = [None, *event.prompt_logprobs]
                    yield writer.text(index, echo.text, echo.token_ids, prompt)
                if isinstance(event, Finished):
                    finished[index] = event
                    yield writer.finish(index, event)
                elif event.text or event.logprobs:
                    yield writer.text(index, event.text, event.token_ids, event.logprobs)
        ordered = [finished[i] for i in range(len(generations))]
        yield writer.done(ordered, parsed.n, parsed.include_usage)
    except ApiError as exc:
        failed = True
        yield writer.error(exc)
    finally:
        for generation in generations:
            generation.close(lost=failed)
