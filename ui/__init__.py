"""The Gradio dashboard: chat and live Plotly views of the KV cache, from telemetry only."""

import os

import gradio as gr
from starlette.middleware import Middleware

from kvscope.engine.entrypoints.view import EngineView
from kvscope.ui.dashboard import CSS_PATH, build_ui
from kvscope.ui.frame_guard import FrameGuard

__all__ = ["CSS_PATH", "build_ui", "mount_ui", "page_options"]

# A server that logs every prompt must not call out: Gradio's usage analytics (read when a
# gr.Blocks is built) stay off unless GRADIO_ANALYTICS_ENABLED=True is set explicitly.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def mount_ui(app, engine: EngineView, session_log=None, path: str = "/"):
    """Mount the dashboard on a FastAPI app."""
    return gr.mount_gradio_app(app, build_ui(engine, session_log), path=path,
                               **page_options())


def page_options() -> dict:
    """What Gradio 6 takes at mount or launch time rather than in gr.Blocks: the CSS, and
    the FrameGuard middleware on Gradio's own app. A fresh dict each call (Gradio adds
    to app_kwargs)."""
    return {"css_paths": [CSS_PATH], "app_kwargs": {"middleware": [Middleware(FrameGuard)]}}
