"""create_app(): the FastAPI app serving one EngineView (API, /metrics, /ws/events)."""

import asyncio
import contextlib
from collections.abc import Callable

from fastapi import FastAPI

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.serving.chat_parsing import ChatParsing
from kvscope.engine.serving.errors import install_error_handlers
from kvscope.engine.serving.metrics import EngineMetrics, metrics_router
from kvscope.engine.serving.routes import ServedModel, health_router, openai_router, version
from kvscope.engine.serving.security import ALWAYS_OPEN_PATHS, AccessGuard, APIKeyCheck, BodySizeLimit
from kvscope.engine.serving.sessions import SessionStore, login_router
from kvscope.engine.serving.tokenization import tokenization_router
from kvscope.engine.serving.websocket import events_router

DEFAULT_MAX_BODY_BYTES = 1 << 20


@contextlib.asynccontextmanager
async def observe_finished_requests(app: FastAPI):
    """The app's lifespan: /metrics' histograms observe each request as it ends, not at
    the next scrape (EngineMetrics.observe_finished)."""
    metrics: EngineMetrics = app.state.metrics
    observer = asyncio.create_task(metrics.observe_finished())
    try:
        yield
    finally:
        metrics.close()
        await observer


def create_app(engine: EngineView, *, api_key: str | None = None, metrics_auth: bool = False,
               served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_parsing: ChatParsing = ChatParsing(),
               durable: Callable[[], object] | None = None) -> FastAPI:
    """The app for a started engine; the caller owns the engine's lifetime.

    With an `api_key`, every route, including a dashboard mounted on this app later, needs
    it (see AccessGuard), except /health and /version, and /metrics unless `metrics_auth`
    (as in vLLM, so probes and scrapers need no secret). `chat_parsing`: the tool-call
    and reasoning parsers chat answers go through. `durable`: called before each final
    answer goes out (app.py's makes the finished requests' rows durable first).
    """
    app = FastAPI(title="kvscope", version=version(), lifespan=observe_finished_requests)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        auth, sessions = APIKeyCheck(api_key), SessionStore()
        app.include_router(login_router(auth.matches, sessions))
        open_paths = ALWAYS_OPEN_PATHS if metrics_auth else ALWAYS_OPEN_PATHS | {"/metrics"}
        # Added last, so it runs first: a refused request is never read or routed.
        app.add_middleware(AccessGuard, auth=auth, sessions=sessions, open_paths=open_paths)
    model = ServedModel.of(engine, served_model_name)
    metrics = EngineMetrics(engine, model.name)
    app.include_router(openai_router(engine, model, chat_parsing, durable))
    app.include_router(tokenization_router(engine, model))
    app.include_router(health_router(engine))
    app.include_router(metrics_router(metrics))
    app.include_router(events_router(engine))
    app.state.engine = engine
    app.state.served_model = model
    app.state.metrics = metrics
    return app
