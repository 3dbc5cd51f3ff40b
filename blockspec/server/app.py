"""The OpenAI-compatible HTTP server: FastAPI routes over one engine thread.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `"stream": true`
as server-sent events in OpenAI's chunk format, `stream_options.include_usage` for a final usage
chunk, then `data: [DONE]`), GET /health, GET /metrics (Prometheus text).
With an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); /health and
/metrics stay open for probes and scrapers. Every error is OpenAI's error JSON; nothing is a bare 500.
A client that disconnects (streaming or not) has its request aborted and its KV freed before the
engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError
from blockspec.server.async_engine import AsyncEngine, Output
from blockspec.server.metrics import Metrics
from blockspec.server.protocol import (
    APIError, ParsedRequest, chat_messages, choice, envelope, extension, parse_request, sampling_params,
    usage,
)

log = logging.getLogger("blockspec.server")


def create_app(llm, api_key: str | None = None, served_model_name: str | None = None) -> FastAPI:
    """An app serving `llm` (a blockspec.LLM, its engine settings in llm.config); the engine thread starts
    and stops with the app."""
    scheduler = llm.scheduler()
    metrics = Metrics(llm.block_size)
    engine = AsyncEngine(scheduler, llm.tokenizer, metrics)
    model_name = served_model_name or llm.model_path.name
    algorithm = llm.speculative_algorithm
    block_size = llm.block_size

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.llm, app.state.metrics, app.state.model_name = (
        engine, llm, metrics, model_name)

    def error(exc: APIError) -> JSONResponse:
        metrics.http_error(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(APIError(400, f"Invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return error(APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                              kind="internal_error"))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if (scheme.lower() != "bearer"
                or not secrets.compare_digest(token.strip().encode(), api_key.encode())):
            raise APIError(401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        status = 200 if engine.alive else 503
        return JSONResponse({"status": "ok" if status == 200 else "engine stopped", **engine.snapshot},
                            status)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "blockspec",
                "max_model_len": llm.max_model_len, "speculative_algorithm": algorithm,
                "block_size": block_size}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"The request body is not valid JSON: {exc}.") from exc
        if isinstance(body, dict) and body.get("model") is not None and body.get("model") != model_name:
            raise APIError(400, f"The model {body['model']!r} does not exist; "
                                f"this server serves {model_name!r} (see GET /v1/models).",
                           param="model", code="model_not_found")
        parsed = parse_request(body, chat)
        seq = make_sequence(body, parsed, chat)
        if not engine.alive:
            raise APIError(503, "The engine is not running; the server is starting or stopping.",
                           kind="server_error")
        outputs = engine.submit(seq, parsed.stop)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if parsed.stream:
            return StreamingResponse(stream(seq, outputs, parsed, chat, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, seq, outputs, chat, rid, created)

    def make_sequence(body: dict, parsed: ParsedRequest, chat: bool) -> Sequence:
        try:
            prompt = llm.tokenizer.apply_chat_template(chat_messages(body)) if chat else parsed.prompt
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            max_tokens = parsed.max_tokens
            if max_tokens is None:  # chat without max_tokens: the rest of the context
                max_tokens = llm.max_model_len - len(ids)
                if max_tokens < 1:
                    raise APIError(400, f"The prompt has {len(ids)} tokens, which fills the context length "
                                        f"max_model_len={llm.max_model_len}. Shorten it.",
                                   param="messages", code="context_length_exceeded")
            seq = llm.sequence(ids, sampling_params(parsed, max_tokens))
            scheduler.check(seq)
            return seq
        except BlockspecError as exc:
            code = ("context_length_exceeded" if "context length" in str(exc) or "KV tokens" in str(exc)
                    else None)
            raise APIError(400, str(exc), param="messages" if chat else "prompt", code=code) from exc

    def final(out: Output) -> dict:
        return extension(out.stats, algorithm, block_size)

    async def stream(seq: Sequence, outputs: asyncio.Queue, parsed: ParsedRequest, chat: bool, rid: str,
                     created: int) -> AsyncIterator[str]:
        done = False
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse(envelope(chat, True, rid, created, model_name, [first]))
            while True:
                out: Output = await outputs.get()
                if out.error is not None:
                    done = True
                    yield sse(APIError(500, out.error, kind="internal_error").body())
                    break
                if out.text:
                    yield sse(envelope(chat, True, rid, created, model_name,
                                       [choice(chat, out.text, None, True)]))
                if out.finish_reason is not None:
                    done = True
                    yield sse(envelope(chat, True, rid, created, model_name,
                                       [choice(chat, "", out.finish_reason, True)], blockspec=final(out)))
                    if parsed.include_usage:
                        yield sse(envelope(chat, True, rid, created, model_name, [],
                                           usage=usage(len(seq.prompt_ids), out.num_output_tokens)))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the KV now
                engine.abort(seq.seq_id)

    async def collect(request: Request, seq: Sequence, outputs: asyncio.Queue, chat: bool, rid: str,
                      created: int) -> Response:
        pieces: list[str] = []
        pending: asyncio.Future | None = None
        # The body is read, so the next ASGI message can only be http.disconnect: watch for it.
        watch: asyncio.Future = asyncio.ensure_future(request.receive())
        done = False
        try:
            while True:
                pending = pending or asyncio.ensure_future(outputs.get())
                await asyncio.wait({pending, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    if watch.result().get("type") == "http.disconnect":
                        return Response(status_code=499)  # nobody to answer; `finally` frees the KV
                    watch = asyncio.ensure_future(request.receive())
                    continue
                out: Output = pending.result()
                pending = None
                if out.error is not None:
                    done = True
                    raise APIError(500, out.error, kind="internal_error")
                pieces.append(out.text)
                if out.finish_reason is not None:
                    done = True
                    body = envelope(chat, False, rid, created, model_name,
                                    [choice(chat, "".join(pieces), out.finish_reason, False)],
                                    usage=usage(len(seq.prompt_ids), out.num_output_tokens),
                                    blockspec=final(out))
                    return JSONResponse(body)
        finally:
            for task in (pending, watch):
                if task is not None:
                    task.cancel()
            if not done:
                engine.abort(seq.seq_id)

    return app


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
