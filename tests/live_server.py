"""A real uvicorn server on 127.0.0.1 in a thread, for tests that talk to it over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def start_server(llm, **app_settings) -> Iterator[dict]:
    """Serve `llm` (create_app's settings in app_settings) until the block ends: {"app", "url", "port"}."""
    import uvicorn

    from blockspec.server.app import create_app

    app = create_app(llm, **app_settings)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "the test server did not start"
    try:
        yield {"app": app, "url": f"http://127.0.0.1:{port}", "port": port}
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
