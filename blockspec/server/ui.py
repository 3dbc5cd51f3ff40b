"""The built-in chat page (`GET /`, off with `blockspec serve --no-ui`) and the engine's live view
(`GET /stats`, live.py).

The page is the files in blockspec/server/static, shipped in the package and read once at start:
`index.html` at `/`, its scripts, style and icon under `/ui/`. They reference each other and the API by
relative URLs only, so the page works wherever the server is reached (another machine, a path prefix
behind a proxy). Every file goes out with a Content-Security-Policy that lets the page run only its own
script and style and talk only to this server (no inline script or style, no other origin, no frames),
gzip-compressed when the browser accepts it, and with an ETag for cheap revalidation.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

STATIC = Path(__file__).parent / "static"
# route -> (file in STATIC, media type)
PAGES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    **{f"/ui/{name}": (name, "text/javascript; charset=utf-8")  # in the order index.html runs them
       for name in ("common.js", "settings.js", "markdown.js", "reply.js", "stream.js", "live.js",
                    "chat.js")},
    "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-DNS-Prefetch-Control": "off",  # links in a reply resolve nothing until clicked
    "Cache-Control": "no-cache",  # revalidated every time (an ETag makes that a 304), so an upgrade shows
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes
    media_type: str
    etag: str

    @classmethod
    def load(cls, name: str, media_type: str) -> Asset:
        body = (STATIC / name).read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        return cls(body, gzip.compress(body, compresslevel=9, mtime=0), media_type, etag)

    def response(self, request: Request) -> Response:
        headers = {**SECURITY_HEADERS, "ETag": self.etag, "Vary": "Accept-Encoding"}
        if self.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(self.gzipped, media_type=self.media_type,
                            headers={**headers, "Content-Encoding": "gzip"})
        return Response(self.body, media_type=self.media_type, headers=headers)


def add_chat_page(app: FastAPI) -> None:
    """Serve the chat page and its files."""
    for route, (name, media_type) in PAGES.items():
        app.add_api_route(route, _serve(Asset.load(name, media_type)), methods=["GET"],
                          include_in_schema=False)


def _serve(asset: Asset):
    async def serve(request: Request) -> Response:
        return asset.response(request)

    return serve


def add_live_view(app: FastAPI, engine, algorithm: str, adaptive: bool) -> None:
    """`GET /stats`: the engine's live view (open like /metrics: counters and gauges, no request content)."""

    async def stats() -> JSONResponse:
        return JSONResponse(engine.live.snapshot(engine.snapshot, algorithm, adaptive),
                            headers={"Cache-Control": "no-store"})

    app.add_api_route("/stats", stats, methods=["GET"], include_in_schema=False)
