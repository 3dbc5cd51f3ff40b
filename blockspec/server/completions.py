"""/v1/completions and /v1/chat/completions: a request's choices (n per prompt, every prompt of a list)
become engine requests sharing one queue; their outputs come back as server-sent events (OpenAI's chunk
format, `stream_options.include_usage` for a final usage chunk, then `data: [DONE]`) or as one JSON body.

A client that disconnects (streaming or not) has every choice aborted and its KV freed before the engine's
next step. Prompts are tokenized on a worker thread, a text far longer than the context refused early.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from blockspec.engine.sequence import Sequence
from blockspec.engine.stats import RequestStats
from blockspec.engine.text_stream import Piece
from blockspec.errors import BlockspecError
from blockspec.server import token_sources
from blockspec.server.async_engine import AsyncEngine, Output
from blockspec.server.logprobs import chat_logprobs, completion_logprobs
from blockspec.server.protocol import APIError, ParsedRequest, chat_messages, sampling_params
from blockspec.server.responses import choice, envelope, extension, usage

CHARS_PER_TOKEN_BOUND = 16  # text tokenizes to ~4 characters a token; a prefix this long per token suffices


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def failure(out: Output) -> APIError:
    if out.shutdown:
        return APIError(503, out.error, kind="server_error", code="server_shutting_down")
    return APIError(500, out.error, kind="internal_error")


class Completion:
    """One HTTP request's choices in the engine: submitted together, answered together."""

    def __init__(self, llm, engine: AsyncEngine, model_name: str, parsed: ParsedRequest, chat: bool,
                 seqs: list[Sequence], prompts: list[list[int]], sources: bool = False) -> None:
        """`sources`: the request asked for its tokens' sources (token_sources.py)."""
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.parsed, self.chat, self.seqs, self.prompts = parsed, chat, seqs, prompts
        self.rid, self.created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        self.outputs: asyncio.Queue = asyncio.Queue()
        for index, seq in enumerate(seqs):
            engine.submit(seq, outputs=self.outputs, index=index, token_sources=sources)
        self.finished: dict[int, Output] = {}
        self.sent = [0] * len(seqs)  # characters of text sent per choice (completions' text_offset)
        given = [p if isinstance(p, str) else self.llm.tokenizer.decode(p) for p in parsed.prompts]
        self.echoes = [given[i // parsed.n] if parsed.echo else "" for i in range(len(seqs))]

    # ---- shared ------------------------------------------------------------------------------------
    def envelope(self, choices: list[dict], stream: bool, **extra: Any) -> dict:
        return envelope(self.chat, stream, self.rid, self.created, self.model_name, choices, **extra)

    def logprobs(self, out: Output) -> dict | None:
        if self.parsed.params["logprobs"] is None:
            return None
        token_text = self.token_text
        if self.chat:
            return chat_logprobs(out.logprobs, token_text)
        offset = self.sent[out.index] + len(self.echoes[out.index])
        return completion_logprobs(out.logprobs, token_text, offset)

    def token_text(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self) -> dict:
        """Each prompt counted once (as OpenAI does for n choices), its cached tokens its first choice's."""
        completion = sum(out.num_output_tokens for out in self.finished.values())
        n = self.parsed.n
        cached = sum(min(self.seqs[i * n].cached_tokens, len(p)) for i, p in enumerate(self.prompts))
        return usage(sum(len(p) for p in self.prompts), completion, cached)

    def abort_unfinished(self) -> None:
        for index, seq in enumerate(self.seqs):
            if index not in self.finished:
                self.engine.abort(seq.seq_id)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.seqs)

    # ---- server-sent events ------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        try:
            for index, echo in enumerate(self.echoes):
                if self.chat:
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield sse(self.envelope([first], True))
                elif echo:
                    yield sse(self.envelope([choice(False, echo, None, True, index)], True))
            while not self.done:
                out: Output = await self.outputs.get()
                if out.error is not None:
                    yield sse(failure(out).body())
                    break
                if out.text or out.logprobs or out.pieces:
                    piece = token_sources.attach(
                        choice(self.chat, out.text, None, True, out.index, self.logprobs(out)), out.pieces)
                    self.sent[out.index] += len(out.text)
                    yield sse(self.envelope([piece], True))
                if out.finish_reason is not None:
                    self.finished[out.index] = out
                    last = choice(self.chat, "", out.finish_reason, True, out.index)
                    yield sse(self.envelope([last], True, blockspec=self.extension([out.stats])))
            if self.done and self.parsed.include_usage:
                yield sse(self.envelope([], True, usage=self.usage()))
            yield "data: [DONE]\n\n"
        finally:  # the client went away, a choice failed or the server is stopping: free the KV now
            self.abort_unfinished()

    # ---- one JSON body -----------------------------------------------------------------------------
    async def collect(self, request: Request) -> Response:
        pieces: list[list[str]] = [[echo] for echo in self.echoes]
        logprobs: list[list] = [[] for _ in self.seqs]
        sources: list[list[Piece] | None] = [None for _ in self.seqs]
        pending: asyncio.Future | None = None
        # The body is read, so the next ASGI message can only be http.disconnect: watch for it.
        watch: asyncio.Future = asyncio.ensure_future(request.receive())
        try:
            while not self.done:
                pending = pending or asyncio.ensure_future(self.outputs.get())
                await asyncio.wait({pending, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    if watch.result().get("type") == "http.disconnect":
                        return Response(status_code=499)  # nobody to answer; `finally` frees the KV
                    watch = asyncio.ensure_future(request.receive())
                    continue
                out: Output = pending.result()
                pending = None
                if out.error is not None:
                    raise failure(out)
                pieces[out.index].append(out.text)
                logprobs[out.index] += out.logprobs
                if out.pieces is not None:
                    sources[out.index] = (sources[out.index] or []) + out.pieces
                if out.finish_reason is not None:
                    self.finished[out.index] = out
            choices = []
            for index, out in sorted(self.finished.items()):
                whole = Output("", out.num_output_tokens, out.finish_reason, logprobs=logprobs[index],
                               index=index)
                reply = choice(self.chat, "".join(pieces[index]), out.finish_reason, False, index,
                               self.logprobs(whole))
                choices.append(token_sources.attach(reply, sources[index]))
            stats = [out.stats for out in self.finished.values()]
            return JSONResponse(self.envelope(choices, False, usage=self.usage(),
                                              blockspec=self.extension(stats)))
        finally:
            for task in (pending, watch):
                if task is not None:
                    task.cancel()
            self.abort_unfinished()

    def extension(self, stats: list[RequestStats]) -> dict:
        return extension(RequestStats.pooled(stats), self.llm.speculative_algorithm, self.llm.block_size)


def make_sequences(llm, scheduler, body: dict, parsed: ParsedRequest, chat: bool) -> tuple[list[Sequence],
                                                                                          list[list[int]]]:
    """The request's engine sequences (n per prompt, in choice order) and each prompt's token ids; runs on a
    worker thread (tokenizing holds the GIL)."""
    param = "messages" if chat else "prompt"
    try:
        texts = [llm.chat_prompt(chat_messages(body))] if chat else parsed.prompts
        prompts = [encode(llm, t, param) if isinstance(t, str) else t for t in texts]
        seqs = []
        for ids in prompts:
            max_tokens = parsed.max_tokens
            if max_tokens is None:  # chat without max_tokens: the rest of the context
                max_tokens = llm.max_model_len - len(ids)
                if max_tokens < 1:
                    raise APIError(400, f"The prompt has {len(ids)} tokens, which fills the context length "
                                        f"max_model_len={llm.max_model_len}. Shorten it.",
                                   param=param, code="context_length_exceeded")
            for index in range(parsed.n):
                seq = llm.sequence(ids, sampling_params(parsed, max_tokens, index))
                scheduler.check(seq)
                seqs.append(seq)
        return seqs, prompts
    except BlockspecError as exc:
        code = ("context_length_exceeded" if "context length" in str(exc) or "KV tokens" in str(exc)
                else None)
        raise APIError(400, str(exc), param=param, code=code) from exc


def encode(llm, text: str, param: str) -> list[int]:
    """Token ids of a prompt, bounded: the tokenizer holds the GIL while it runs (the event loop then
    stalls), so a text far longer than the context is refused once a prefix already fills it."""
    limit = llm.max_model_len * CHARS_PER_TOKEN_BOUND
    if len(text) > limit and len(llm.tokenizer.encode(text[:limit])) >= llm.max_model_len:
        raise APIError(400, f"The prompt ({len(text)} characters) holds more tokens than the context "
                            f"length max_model_len={llm.max_model_len}. Shorten it.", param=param,
                       code="context_length_exceeded")
    return llm.tokenizer.encode(text)


def streaming_response(completion: Completion) -> StreamingResponse:
    return StreamingResponse(completion.stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
