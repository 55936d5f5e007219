"""Serve a built site on localhost with the standard library's HTTP server."""

from __future__ import annotations

import functools
import http.server
import os
from pathlib import Path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        pass


def make_server(directory: str | os.PathLike, port: int = 8000, *, quiet: bool = False,
                host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """A server for ``directory`` bound to ``host`` (localhost by default); port 0 picks a free one."""
    root = Path(directory)
    if not (root / "index.html").is_file():
        raise FileNotFoundError(f"{root}/index.html not found; run `openrecipes site build` first")
    handler = _QuietHandler if quiet else http.server.SimpleHTTPRequestHandler
    return http.server.ThreadingHTTPServer((host, port), functools.partial(handler, directory=str(root)))
