"""The Gradio dashboard: chat and live Plotly views of the KV cache, from telemetry only."""

import os

import gradio as gr

from engine.view import EngineView
from ui.dashboard import CSS_PATH, build_ui

__all__ = ["CSS_PATH", "build_ui", "mount_ui"]

# A server that logs every prompt must not call out: Gradio's usage analytics (read when a
# gr.Blocks is built) stay off unless GRADIO_ANALYTICS_ENABLED=True is set explicitly.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def mount_ui(app, engine: EngineView, session_log=None, path: str = "/"):
    """Mount the dashboard on a FastAPI app (Gradio 6 takes the CSS at mount time)."""
    return gr.mount_gradio_app(app, build_ui(engine, session_log), path=path,
                               css_paths=[CSS_PATH])
