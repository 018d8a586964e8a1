"""The HTTP edge: OpenAI-compatible routes, SSE, /metrics, /health and /ws/events."""

from kvscope.engine.serving.app import create_app

__all__ = ["create_app"]
