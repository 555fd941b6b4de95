"""The one error type a request can end with, raised in any room of the server.

`APIError` carries an HTTP status, a message and the offending field (`param`); it knows no API.
Each API module (`serve.http.openai_api`, `anthropic_api`, `responses_api`) shapes it into its own
error JSON, so an error is raised once, wherever it is found (parsing, rendering, the engine, the
engine-core process), and answered in the shape of the API that received the request.
"""
from __future__ import annotations


class APIError(Exception):
    """An HTTP error: status, message, the request field at fault (`param`), a machine-readable
    `code`, an error `type` (OpenAI's vocabulary; the Anthropic module maps it) and headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}
