"""Browser sessions: a login page that trades the API key for a session cookie."""

import hashlib
import html
import secrets
import time
from collections.abc import Callable
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.types import Scope

SESSION_MAX_AGE_S = 24 * 3600
MAX_LOGIN_BODY_BYTES = 4096

LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvscope: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; background: #0f172a; color: #e2e8f0;
       display: flex; align-items: center; justify-content: center; height: 100vh; margin: 0; }}
form {{ background: #1e293b; padding: 2rem; border-radius: 8px; width: 22rem; }}
h1 {{ font-size: 1.3rem; margin-top: 0; }}
input, button {{ width: 100%; box-sizing: border-box; padding: .6rem; margin-top: .5rem;
                 border-radius: 4px; border: 1px solid #475569; font-size: 1rem; }}
button {{ background: #2563eb; color: white; border: none; cursor: pointer; }}
.error {{ color: #fca5a5; }}
</style></head>
<body><form method="post" action="login">
<h1>kvscope</h1>
<label for="password">API key</label>
<input id="password" name="password" type="password" autocomplete="current-password" autofocus>
<button type="submit" id="login">Log in</button>
<p class="error" id="login-error">{error}</p>
</form></body></html>
"""


def session_cookie_name(scope: Scope) -> str:
    """Per port, so two kvscope servers on one host keep separate sessions."""
    server = scope.get("server") or ("", 0)
    return f"kvscope-session-{server[1]}"


class SessionStore:
    """Sessions of browsers that entered the key: random tokens, kept as their SHA-256 (a
    lookup reveals nothing about a valid token) with an expiry; lost on restart."""

    def __init__(self, max_age_s: float = SESSION_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._expiry: dict[str, float] = {}

    def issue(self) -> str:
        now = time.time()
        self._expiry = {digest: t for digest, t in self._expiry.items() if t > now}
        token = secrets.token_urlsafe(32)
        self._expiry[_digest(token)] = now + self.max_age_s
        return token

    def valid(self, token: str | None) -> bool:
        return token is not None and self._expiry.get(_digest(token), 0.0) > time.time()

    def revoke(self, token: str | None) -> None:
        if token is not None:
            self._expiry.pop(_digest(token), None)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def login_router(key_matches: Callable[[str], bool], sessions: SessionStore) -> APIRouter:
    """GET /login (the form), POST /login (form field `password`: the key, as Gradio's own
    login and gradio_client's `auth=(user, key)` send it), GET /logout."""
    router = APIRouter()

    @router.get("/login", include_in_schema=False)
    async def login_page() -> HTMLResponse:
        return HTMLResponse(LOGIN_PAGE.format(error=""))

    @router.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        key = await _form_field(request, "password")
        if key is None or not key_matches(key):
            return HTMLResponse(LOGIN_PAGE.format(error=html.escape("Wrong API key.")),
                                status_code=401)
        # A browser's form post follows a redirect into the dashboard; API clients
        # (gradio_client) want a 2xx and the cookie.
        response: Response = (
            RedirectResponse(f"{request.scope.get('root_path', '')}/", status_code=303)
            if "text/html" in request.headers.get("accept", "")
            else JSONResponse({"success": True}))
        response.set_cookie(session_cookie_name(request.scope), sessions.issue(),
                            max_age=int(sessions.max_age_s), httponly=True, samesite="lax",
                            secure=request.url.scheme == "https")
        return response

    @router.get("/logout", include_in_schema=False)
    async def logout(request: Request) -> RedirectResponse:
        name = session_cookie_name(request.scope)
        sessions.revoke(request.cookies.get(name))
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login",
                                    status_code=303)
        response.delete_cookie(name)
        return response

    return router


async def _form_field(request: Request, name: str) -> str | None:
    """One field of a small url-encoded form; None if absent or the body is oversized."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY_BYTES:
            return None
    values = parse_qs(body.decode("utf-8", "replace")).get(name)
    return values[0] if values else None
