"""create_app(): the FastAPI app serving one AsyncEngine (API, /metrics, /ws/events)."""

from fastapi import FastAPI

from engine.async_engine import AsyncEngine
from engine.serving.errors import install_error_handlers
from engine.serving.metrics import EngineMetrics, metrics_router
from engine.serving.routes import ServedModel, health_router, openai_router, version
from engine.serving.security import APIKeyCheck, BodySizeLimit
from engine.serving.websocket import events_router

DEFAULT_MAX_BODY_BYTES = 1 << 20


def create_app(engine: AsyncEngine, *, api_key: str | None = None,
               served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app for a started engine; the caller owns the engine's lifetime.

    `api_key` guards /v1/* and /ws/events; /health, /version and /metrics stay open
    (as in vLLM) so probes and scrapers need no secret.
    """
    app = FastAPI(title="kvscope", version=version())
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    auth = APIKeyCheck(api_key)
    model = ServedModel.of(engine, served_model_name)
    app.include_router(openai_router(engine, model, auth))
    app.include_router(health_router(engine))
    app.include_router(metrics_router(EngineMetrics(engine, model.name)))
    app.include_router(events_router(engine, auth))
    app.state.engine = engine
    app.state.served_model = model
    return app
