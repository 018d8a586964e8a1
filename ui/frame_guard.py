"""FrameGuard: an ASGI middleware that puts ui/frame_guard.js first in the dashboard's
pages, before Gradio's own scripts (which capture requestAnimationFrame when they load;
gr.Blocks(head=...) is added by those scripts later, too late for that)."""

from pathlib import Path

FRAME_GUARD_JS = Path(__file__).resolve().parent / "frame_guard.js"


class FrameGuard:
    """Wraps Gradio's app: an HTML page gets the frame guard's <script> right after its
    <head>; every other response passes through untouched."""

    def __init__(self, app) -> None:
        self.app = app
        self.script = b"<script>" + FRAME_GUARD_JS.read_bytes() + b"</script>"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, chunks = None, []

        async def send_guarded(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _plain_html(message["headers"]):
                start = message  # held until the whole page is here
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            page = b"".join(chunks).replace(b"<head>", b"<head>" + self.script, 1)
            headers = [(name, value) for name, value in start["headers"]
                       if name.lower() != b"content-length"]
            headers.append((b"content-length", str(len(page)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, send_guarded)


def _plain_html(headers) -> bool:
    """An uncompressed HTML response (compression, if any, happens outside this one)."""
    fields = {name.lower(): value for name, value in headers}
    return (fields.get(b"content-type", b"").startswith(b"text/html")
            and b"content-encoding" not in fields)
