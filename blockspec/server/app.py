"""The OpenAI-compatible HTTP server: FastAPI routes over one engine thread.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both
with `"stream": true` as server-sent events in OpenAI's chunk format, `stream_options.include_usage` for
a final usage chunk, then `data: [DONE]`), GET /health, GET /metrics (Prometheus text), GET /stats (the
engine's live view, JSON), and GET / the chat page (ui.py; `chat_page=False` turns it off). A request
may ask for its tokens' sources (token_sources.py).
With an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); /health and
/metrics stay open for probes and scrapers. Every error is OpenAI's error JSON; nothing is a bare 500.
A client that disconnects (streaming or not) has its request aborted and its KV freed before the
engine's next step. Bodies are limited in size (door.py); prompts are tokenized on worker threads, a
few at a time, so the event loop keeps answering while a long prompt is tokenized.
When the server stops (SIGTERM, shutdown.py) it admits nothing new (503); a request still running
when the grace period ends gets an error: a stream its error event and `[DONE]`, others error JSON.
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
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.engine.sequence import Sequence
from blockspec.errors import BlockspecError
from blockspec.server import token_sources, ui
from blockspec.server.async_engine import AsyncEngine, Output
from blockspec.server.door import Door, request_id
from blockspec.server.metrics import Metrics
from blockspec.server.protocol import (
    APIError, ParsedRequest, chat_messages, choice, envelope, extension, parse_request, sampling_params,
    usage,
)

log = logging.getLogger("blockspec.server")
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024  # far above any prompt a context of 32k tokens holds
TOKENIZE_CONCURRENCY = 2  # prompts tokenized at once (each on a worker thread); the others wait their turn
CHARS_PER_TOKEN_BOUND = 16  # text tokenizes to ~4 characters a token; a prefix this long per token suffices


def engine_info(llm) -> dict[str, str]:
    """The labels of blockspec_engine_info: weight blocks ("none": dense), and on the CPU how block weights
    meet activations ("int8" or "fp32")."""
    return {"device": str(llm.device), "quantization": llm.weight_blocks or "none",
            "cpu_activations": llm.activations if llm.weight_blocks else "none",
            "draft_quantization": llm.draft_blocks or "none"}


def create_app(llm, api_key: str | None = None, served_model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               cors_origins: list[str] | None = None, chat_page: bool = True) -> FastAPI:
    """An app serving `llm` (a blockspec.LLM, its engine settings in llm.config); the engine thread starts
    and stops with the app. `cors_origins`: browser origins allowed to call it (None: CORS off).
    `chat_page`: serve the chat page at `/`."""
    scheduler = llm.scheduler()
    metrics = Metrics(llm.block_size, engine_info(llm))
    engine = AsyncEngine(scheduler, llm.tokenizer, metrics)
    model_name = served_model_name or llm.model_path.name
    algorithm = llm.speculative_algorithm
    block_size = llm.block_size
    tokenizing = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.llm, app.state.metrics, app.state.model_name = (
        engine, llm, metrics, model_name)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(Door, max_body_bytes=max_request_bytes, on_error=metrics.http_error)

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
        state = "engine stopped" if not engine.alive else "draining" if engine.draining else "ok"
        return JSONResponse({"status": state, **engine.snapshot}, 200 if state == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    ui.add_live_view(app, engine, algorithm, llm.config.adaptive_speculation)
    if chat_page:
        ui.add_chat_page(app)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "blockspec",
            "max_model_len": llm.max_model_len, "speculative_algorithm": algorithm, "block_size": block_size}

    def check_model(name: Any) -> None:
        if name is not None and not isinstance(name, str):
            raise APIError(400, f"'model' must be a string, got {name!r:.80}.", param="model")
        if name is not None and name != model_name:
            raise APIError(404, f"The model {name!r:.200} does not exist; this server serves "
                                f"{model_name!r} (see GET /v1/models).", param="model",
                           code="model_not_found")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return card

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    def refuse_if_stopping() -> None:
        if not engine.alive or engine.draining:
            raise APIError(503, "The server is starting or shutting down and takes no new requests.",
                           kind="server_error", code="server_unavailable")

    async def generate(request: Request, chat: bool) -> Response:
        refuse_if_stopping()
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a 5000-digit number
            what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise APIError(400, f"The request body is not valid JSON: {what:.300}.") from exc
        if isinstance(body, dict):
            check_model(body.get("model"))
        parsed = parse_request(body, chat)
        sources = token_sources.requested(body)
        async with tokenizing:
            seq = await asyncio.to_thread(make_sequence, body, parsed, chat)
        refuse_if_stopping()
        log.debug("request %s is seq %d", request_id(request.scope), seq.seq_id)
        outputs = engine.submit(seq, parsed.stop, sources)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if parsed.stream:
            return StreamingResponse(stream(seq, outputs, parsed, chat, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, seq, outputs, chat, rid, created)

    def encode(text: str, param: str) -> list[int]:
        """Token ids of a prompt, bounded: the tokenizer holds the GIL while it runs (the event loop then
        stalls), so a text far longer than the context is refused once a prefix already fills it."""
        limit = llm.max_model_len * CHARS_PER_TOKEN_BOUND
        if len(text) > limit and len(llm.tokenizer.encode(text[:limit])) >= llm.max_model_len:
            raise APIError(400, f"The prompt ({len(text)} characters) holds more tokens than the context "
                                f"length max_model_len={llm.max_model_len}. Shorten it.", param=param,
                           code="context_length_exceeded")
        return llm.tokenizer.encode(text)

    def make_sequence(body: dict, parsed: ParsedRequest, chat: bool) -> Sequence:
        try:
            prompt = llm.tokenizer.apply_chat_template(chat_messages(body)) if chat else parsed.prompt
            ids = encode(prompt, "messages" if chat else "prompt") if isinstance(prompt, str) else prompt
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

    def failure(out: Output) -> APIError:
        if out.shutdown:
            return APIError(503, out.error, kind="server_error", code="server_shutting_down")
        return APIError(500, out.error, kind="internal_error")

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
                    yield sse(failure(out).body())
                    break
                if out.text or out.pieces:
                    piece = token_sources.attach(choice(chat, out.text, None, True), out.pieces)
                    yield sse(envelope(chat, True, rid, created, model_name, [piece]))
                if out.finish_reason is not None:
                    done = True
                    yield sse(envelope(chat, True, rid, created, model_name,
                                       [choice(chat, "", out.finish_reason, True)], blockspec=final(out)))
                    if parsed.include_usage:
                        yield sse(envelope(chat, True, rid, created, model_name, [],
                                           usage=usage(len(seq.prompt_ids), out.num_output_tokens,
                                                       seq.cached_tokens)))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the KV now
                engine.abort(seq.seq_id)

    async def collect(request: Request, seq: Sequence, outputs: asyncio.Queue, chat: bool, rid: str,
                      created: int) -> Response:
        pieces: list[str] = []
        tokens: list[token_sources.Piece] | None = None
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
                    raise failure(out)
                pieces.append(out.text)
                if out.pieces is not None:
                    tokens = tokens or []
                    tokens.extend(out.pieces)
                if out.finish_reason is not None:
                    done = True
                    reply = token_sources.attach(choice(chat, "".join(pieces), out.finish_reason, False),
                                                 tokens)
                    body = envelope(chat, False, rid, created, model_name, [reply],
                                    usage=usage(len(seq.prompt_ids), out.num_output_tokens,
                                                seq.cached_tokens),
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
