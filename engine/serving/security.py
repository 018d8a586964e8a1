"""The API key check, and the request body size limit."""

import hmac

from fastapi import Request, WebSocket
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.serving.errors import APIError, error_response


class APIKeyCheck:
    """`Authorization: Bearer KEY` on every protected route, when a key is configured."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    def allows(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(),
                                                                  self.api_key.encode())

    async def __call__(self, request: Request) -> None:
        """A FastAPI dependency for HTTP routes."""
        if not self.allows(request.headers.get("authorization")):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    def allows_websocket(self, websocket: WebSocket) -> bool:
        """Browsers cannot set headers on a websocket, so `?api_key=` is accepted too."""
        query_key = websocket.query_params.get("api_key")
        return self.allows(websocket.headers.get("authorization")
                           or (f"Bearer {query_key}" if query_key else None))


class BodySizeLimit:
    """ASGI middleware: request bodies over `max_bytes` under `prefix` get an OpenAI-shaped
    413 (other paths, such as the dashboard's uploads, are left alone).

    A declared Content-Length is refused before reading; a chunked body is counted as it
    arrives, and the HTTPException raised past the limit reaches the app's handlers.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, prefix: str = "/v1") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        message = f"request body over {self.max_bytes} bytes"
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(APIError(413, message, code="request_too_large"))
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, message)
            return event

        await self.app(scope, counting_receive, send)
