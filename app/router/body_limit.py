"""HTTP request bodies over a limit are refused with 413 before anything reads them whole (JSON parsing,
tokenization): an ASGI middleware. A body without a Content-Length is read and counted here first.

The limits are this process's (`set_limits`, called by the Router replica from the schema; one Router replica per
process): the FastAPI app is built at import, before any config is known, and Serve may hand the replica a copy of
it, so the limits live here, not on the app object. Until they are set, nothing is limited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Multipart framing around an uploaded file (boundaries, part headers, the `purpose` field).
MULTIPART_OVERHEAD_BYTES = 64 * 1024
UPLOAD_PATH = "/v1/files"


@dataclass(frozen=True)
class BodyLimits:
    request_bytes: int  # router.max_request_bytes
    upload_bytes: int  # batch.max_file_bytes

    def for_path(self, path: str) -> int:
        if path == UPLOAD_PATH:
            return self.upload_bytes + MULTIPART_OVERHEAD_BYTES
        return self.request_bytes


def _error_body(limit: int) -> bytes:
    return json.dumps({"error": {
        "message": f"the request body is larger than the {limit}-byte limit (router.max_request_bytes; uploads: "
                   "batch.max_file_bytes)", "type": "invalid_request_error", "param": None,
        "code": "request_too_large"}}).encode()


_limits: BodyLimits | None = None


def set_limits(limits: BodyLimits | None) -> None:
    global _limits
    _limits = limits


class BodySizeLimit:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        limits = _limits
        if scope["type"] != "http" or limits is None:
            return await self.app(scope, receive, send)
        limit = limits.for_path(scope.get("path", ""))
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    return await self._refuse(send, limit)
                return await self.app(scope, receive, send)
        # No Content-Length (a chunked body): read it here, counting, and hand the app what arrived.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                return await self._refuse(send, limit)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, limit: int) -> None:
        body = _error_body(limit)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
