"""What every HTTP request passes before a route sees it: a request id, a body size limit, and a last
line of defence that turns an unexpected exception into OpenAI's error JSON without dropping the
connection.

- `x-request-id`: a client's own (printable ASCII, up to 128 characters) is echoed, otherwise one is
  made; every response carries it, and the server's log lines about the request name it.
- Body size: a request whose Content-Length is over the limit is refused with 413 before a byte of its
  body is read; a chunked body is counted as it arrives and refused the moment it passes the limit
  (`BodyTooLarge`, raised from the route's read of the body). Memory thus stays bounded whatever a
  client sends.
- A crash inside a route becomes a 500 with the error JSON; Starlette's own handler would re-raise it
  after answering, and the server would then close a keep-alive connection the client still uses.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Awaitable, Callable

from blockspec.server.protocol import APIError

log = logging.getLogger("blockspec.server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this server accepts ({limit} bytes; "
                              f"--max-request-bytes).", code="request_too_large")


def request_id(scope: Scope) -> str:
    """The id the door gave this request (in the ASGI scope)."""
    return scope.get("state", {}).get("request_id", "")


class Door:
    def __init__(self, app: ASGIApp, max_body_bytes: int, on_error: Callable[[int], None]) -> None:
        self.app, self.max_body_bytes, self.on_error = app, max_body_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._answer(send_with_id, BodyTooLarge(self.max_body_bytes))
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        try:
            await self.app(scope, counted_receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if started:  # a stream is under way: it can only end; the route's finally frees its request
                log.exception("request %s failed mid-response", rid)
                return
            if not isinstance(exc, APIError):
                log.exception("unhandled error in request %s (%s)", rid, scope.get("path"))
                exc = APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                               kind="internal_error")
            await self._answer(send_with_id, exc)

    async def _answer(self, send: Send, exc: APIError) -> None:
        self.on_error(exc.status)
        body = json.dumps(exc.body()).encode()
        await send({"type": "http.response.start", "status": exc.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
