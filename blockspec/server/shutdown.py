"""Graceful shutdown: on SIGTERM (or the first Ctrl-C) the server stops admitting requests (503), lets
the running ones finish for up to a grace period, then ends those still running with an error (a stream
gets its error event and `data: [DONE]`, a plain request OpenAI's error JSON) and only then lets uvicorn
close the connections. A second signal stops at once.

uvicorn on its own waits for open connections and then cancels them mid-stream, so clients would see a
cut connection and no answer; this runs the drain before uvicorn starts its own shutdown.
"""

from __future__ import annotations

import threading
import time
from types import FrameType

import uvicorn

from blockspec.server.async_engine import AsyncEngine

FLUSH_SECONDS = 2.0  # how long the handlers get to write their error answers before uvicorn closes


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_seconds: float) -> None:
        super().__init__(config)
        self.engine, self.grace_seconds = engine, grace_seconds
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drainer is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._drainer = threading.Thread(target=self._drain, args=(sig, frame), name="blockspec-drain",
                                         daemon=True)
        self._drainer.start()

    def _drain(self, sig: int, frame: FrameType | None) -> None:
        engine = self.engine
        engine.stop_admission()
        deadline = time.monotonic() + self.grace_seconds
        while engine.num_requests and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if engine.num_requests:
            engine.end_remaining(f"The server is shutting down; the request did not finish within the "
                                 f"{self.grace_seconds:g} s grace period.")
            deadline = time.monotonic() + FLUSH_SECONDS
            while engine.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # the last answers are on the event loop's queue: let it write them
        super().handle_exit(sig, frame)
