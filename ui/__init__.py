"""The Gradio dashboard: chat and live Plotly views of the KV cache, from telemetry only."""

import gradio as gr

from engine.view import EngineView
from ui.dashboard import CSS_PATH, build_ui

__all__ = ["CSS_PATH", "build_ui", "mount_ui"]


def mount_ui(app, engine: EngineView, session_log=None, path: str = "/"):
    """Mount the dashboard on a FastAPI app (Gradio 6 takes the CSS at mount time)."""
    return gr.mount_gradio_app(app, build_ui(engine, session_log), path=path,
                               css_paths=[CSS_PATH])
