"""Loopback is not a door for web pages.

A server on 127.0.0.1 with no key is reachable by any page a local browser opens: a page may POST
a "simple" request (``text/plain`` JSON needs no CORS preflight) and, with DNS rebinding (a name
of the attacker's that resolves to 127.0.0.1), read the answers. So, before any route runs:

* a POST must say its body is JSON (``application/json``, with or without parameters such as
  ``charset``, or ``application/*+json``): anything else is a 415, which no simple request passes;
* when bound to loopback, the ``Host`` header must name loopback (``localhost``, ``127.x.x.x``,
  ``[::1]``, with any port) or a name of ``--allowed-hosts``: anything else is a 421, which no
  rebound name passes;
* browsers get no CORS headers unless ``--cors-origins`` names origins (Starlette's middleware).

Errors come in the shape of the API the path belongs to.
"""
from __future__ import annotations

import ipaddress
import logging
from typing import Callable, Iterable

from .protocol import APIError

log = logging.getLogger("ds4.serve")

LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")


def is_loopback_name(host: str) -> bool:
    """`host` (a Host header's name, port removed) names this machine's loopback."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header value, without its port (IPv6 in brackets kept whole)."""
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_json_type(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class BrowserGuard:
    """ASGI middleware applying the checks above; `error_response(path, APIError)` shapes errors."""

    def __init__(self, app, *, bind_host: str, allowed_hosts: Iterable[str],
                 error_response: Callable[[str, APIError], object], on_reject: Callable | None = None,
                 access_log: bool = True):
        self.app = app
        self.access_log = access_log
        self.check_host = bind_host in LOOPBACK_BINDS or is_loopback_name(bind_host)
        self.allowed = {h.lower() for h in allowed_hosts}
        self.error_response = error_response
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        error = None
        if self.check_host:
            name = host_name(headers.get("host", "")).lower()
            if not (is_loopback_name(name) or name in self.allowed):
                error = APIError(421, f"Host {headers.get('host', '')!r} is not this server's: bound to loopback, it "
                                      f"answers loopback names and --allowed-hosts only", code="misdirected_request")
        if error is None and scope["method"] == "POST" and not is_json_type(headers.get("content-type", "")):
            error = APIError(415, f"a POST body must be JSON (Content-Type application/json), got "
                                  f"{headers.get('content-type', 'none')!r}", code="unsupported_media_type")
        if error is None:
            return await self.app(scope, receive, send)
        if self.access_log:
            log.info('%s "%s %s" %d error=%r', _client(scope), scope["method"], scope["path"], error.status,
                     error.message)
        if self.on_reject is not None:
            self.on_reject(scope["path"], error.status)
        response = self.error_response(scope["path"], error)
        await response(scope, receive, send)


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
