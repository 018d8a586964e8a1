"""Access control (one key for every surface), and the request body size limit."""

import hmac
import ipaddress
import os
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, RedirectResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvscope.engine.serving.errors import APIError, error_response
from kvscope.engine.serving.sessions import SessionStore, session_cookie_name

API_KEY_ENV = "KVSCOPE_API_KEY"
# Probes need no secret (as in vLLM); the login routes are how a browser gets a session.
ALWAYS_OPEN_PATHS = frozenset({"/health", "/version", "/login", "/logout"})
POLICY_VIOLATION = 1008


class APIKeyCheck:
    """The configured key, compared in constant time."""

    def __init__(self, api_key: str) -> None:
        if not api_key.strip():
            raise ValueError("api_key: empty; leave it unset to serve without a key")
        self._key = api_key.encode()

    def matches(self, candidate: str) -> bool:
        # compare_digest: the time taken must not reveal how much of the key matched.
        return hmac.compare_digest(candidate.encode(), self._key)

    def allows(self, authorization: str | None) -> bool:
        """`Authorization: Bearer KEY`."""
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and self.matches(token)

    def __repr__(self) -> str:  # never the key, should this object end up in a log line
        return "APIKeyCheck(<key hidden>)"


def read_api_key(flag_value: str | None) -> str | None:
    """--api-key, else $KVSCOPE_API_KEY, else None. A key that is set but empty (an unset
    shell variable, say) is an error: its owner believes the server is protected."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"--api-key / ${API_KEY_ENV} is set but empty")
    return key


class AccessGuard:
    """ASGI middleware: the one gate in front of every route when a key is configured.

    /v1/* wants `Authorization: Bearer KEY` (OpenAI clients send it) and answers 401 in
    OpenAI's shape. Everything else (the dashboard page, every Gradio route: config, info,
    queue, predict, upload, file downloads; /ws/events; /docs) takes the bearer key or the
    session cookie set by POST /login, the cookie only from the dashboard's own origin; a
    browser asking for a page is sent to /login, any other request gets a 401 and reaches
    no handler. Open without a key: `open_paths`.
    """

    def __init__(self, app: ASGIApp, auth: APIKeyCheck, sessions: SessionStore,
                 open_paths: frozenset[str]) -> None:
        self.app = app
        self.auth = auth
        self.sessions = sessions
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        connection = HTTPConnection(scope)
        api_route = scope["path"] == "/v1" or scope["path"].startswith("/v1/")
        session = not api_route and self.sessions.valid(
            connection.cookies.get(session_cookie_name(scope)))
        cross_origin = session and not _same_origin(connection.headers)
        if self.auth.allows(connection.headers.get("authorization")) or (
                session and not cross_origin):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closing before accepting answers HTTP 403
            await send({"type": "websocket.close", "code": POLICY_VIOLATION,
                        "reason": "Incorrect API key provided"})
            return
        if cross_origin:
            refusal = JSONResponse({"detail": "cross-origin request refused: its Origin is "
                                    "not this server's Host (a reverse proxy must pass the "
                                    "Host header on)"}, status_code=403)
        else:
            refusal = _refusal(scope, api_route)
        await refusal(scope, receive, send)


def _same_origin(headers: Headers) -> bool:
    """A browser sends the cookie with requests that pages of other origins make (of the
    same site, despite SameSite=Lax; and on a non-loopback host Gradio's CORS lets any
    origin read the answer), so a cookie counts only from the dashboard's own origin.
    Browsers send Origin on every cross-origin request, websocket handshakes included."""
    origin = headers.get("origin")
    if origin is None:
        return True
    own_hosts = {headers.get("host"), headers.get("x-forwarded-host")} - {None}
    return urlsplit(origin).netloc in own_hosts


def _refusal(scope: Scope, api_route: bool):
    if api_route:
        return error_response(APIError(401, "Incorrect API key provided",
                                       code="invalid_api_key"))
    headers = Headers(scope=scope)
    if scope["method"] in ("GET", "HEAD") and "text/html" in headers.get("accept", ""):
        return RedirectResponse(f"{scope.get('root_path', '')}/login", status_code=303)
    return JSONResponse({"detail": "Not authenticated: log in at /login or send "
                                   "`Authorization: Bearer KEY`"},
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, api_key: str | None, allow_unauthenticated: bool,
                     db_path: str) -> str | None:
    """The start-up warning for a server reachable from elsewhere without a key."""
    if api_key is not None or allow_unauthenticated or is_loopback(host):
        return None
    return (f"listening on {host} WITHOUT an API key: the dashboard, its Gradio API (chat, "
            f"knobs, load generator, session exports), /v1 and /ws/events are open to "
            f"anyone who can reach this port, and the session log {db_path} keeps "
            f"every prompt. Set ${API_KEY_ENV} (or --api-key), bind 127.0.0.1, or pass "
            f"--allow-unauthenticated to silence this warning.")


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
