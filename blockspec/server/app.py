"""The OpenAI-compatible HTTP server: FastAPI routes over one engine thread.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both
with `"stream": true` as server-sent events: completions.py; a request may ask for its tokens' sources:
token_sources.py), POST /tokenize and /detokenize (vLLM's shapes: tokenize.py), GET /health, GET /metrics
(Prometheus text), GET /stats (the engine's live view, JSON: live.py), and GET / the chat page (ui.py;
`chat_page=False` turns it off). A model card's `created` is when the server started.
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
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.server import token_sources, ui
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.completions import Completion, make_sequences, streaming_response
from blockspec.server.door import Door, request_id
from blockspec.server.metrics import Metrics
from blockspec.server.protocol import APIError, parse_request
from blockspec.server.tokenize import detokenize, tokenize

log = logging.getLogger("blockspec.server")
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024  # far above any prompt a context of 32k tokens holds
TOKENIZE_CONCURRENCY = 2  # prompts tokenized at once (each on a worker thread); the others wait their turn


def engine_info(llm) -> dict[str, str]:
    """The labels of blockspec_engine_info: weight blocks ("none": dense), and on the CPU how block weights
    meet activations ("int8" or "fp32"), and how sampled requests judge the draft ("none" without one)."""
    return {"device": str(llm.device), "quantization": llm.weight_blocks or "none",
            "cpu_activations": llm.activations if llm.weight_blocks else "none",
            "draft_quantization": llm.draft_blocks or "none",
            "speculative_accept": llm.speculation.accept if llm.speculation is not None else "none"}


def create_app(llm, api_key: str | None = None, served_model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               cors_origins: list[str] | None = None, log_interval: float = 0.0,
               chat_page: bool = True) -> FastAPI:
    """An app serving `llm` (a blockspec.LLM, its engine settings in llm.config); the engine thread starts
    and stops with the app. `cors_origins`: browser origins allowed to call it (None: CORS off);
    `log_interval`: seconds between throughput log lines while busy (0: none); `chat_page`: serve the
    chat page at `/`."""
    scheduler = llm.scheduler()
    metrics = Metrics(llm.block_size, engine_info(llm))
    engine = AsyncEngine(scheduler, llm.tokenizer, metrics, log_interval)
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

    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "blockspec",
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

    async def read_json(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a 5000-digit number
            what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise APIError(400, f"The request body is not valid JSON: {what:.300}.") from exc

    async def generate(request: Request, chat: bool) -> Response:
        refuse_if_stopping()
        body = await read_json(request)
        if isinstance(body, dict):
            check_model(body.get("model"))
        parsed = parse_request(body, chat)
        sources = token_sources.requested(body)
        async with tokenizing:
            seqs, prompts = await asyncio.to_thread(make_sequences, llm, scheduler, body, parsed, chat)
        refuse_if_stopping()
        log.debug("request %s is seqs %s", request_id(request.scope), [seq.seq_id for seq in seqs])
        completion = Completion(llm, engine, model_name, parsed, chat, seqs, prompts, sources)
        if parsed.stream:
            return streaming_response(completion)
        return await completion.collect(request)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize_route(request: Request) -> dict:
        body = await read_json(request)
        if isinstance(body, dict):
            check_model(body.get("model"))
        async with tokenizing:
            return await asyncio.to_thread(tokenize, llm, body)

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize_route(request: Request) -> dict:
        body = await read_json(request)
        if isinstance(body, dict):
            check_model(body.get("model"))
        return detokenize(llm, body)

    return app

