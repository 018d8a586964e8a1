"""The OpenAI-compatible routes (/v1/*) and /health, /version."""

import asyncio
import dataclasses
import importlib.metadata
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.chat import template_supports_tools
from kvscope.engine.orchestrator.streams import RequestStream
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving.chat_output import ChatOutputParser
from kvscope.engine.serving.chat_parsing import ChatParsing
from kvscope.engine.serving.errors import APIError
from kvscope.engine.serving.generation import Generation
from kvscope.engine.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 2
DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServedModel:
    """The name clients use (the model folder's), plus the paths that name it too."""

    name: str
    aliases: frozenset[str]

    @classmethod
    def of(cls, engine: EngineView, name: str | None = None) -> "ServedModel":
        path = Path(engine.model_path)
        configured = engine.config.model
        return cls(name or path.name, frozenset(
            str(p) for p in (path, configured, path.resolve()) if p is not None))

    def check(self, requested: str | None) -> None:
        if requested is not None and requested != self.name and requested not in self.aliases:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                           f"`{self.name}`", param="model", code="model_not_found")


def version() -> str:
    try:
        return importlib.metadata.version("kvscope")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout, not installed
        return "unknown"


def openai_router(engine: EngineView, model: ServedModel,
                  chat_parsing: ChatParsing = ChatParsing(),
                  durable: Callable[[], object] | None = None) -> APIRouter:
    router = APIRouter(prefix="/v1")  # the key, if any, is checked by AccessGuard

    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": int(time.time()),
            "owned_by": "kvscope", "root": engine.model_path,
            "max_model_len": engine.config.max_model_len}]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        model.check(body.model)
        params = body.to_params(engine.default_sampling)
        prompts = body.prompts()
        return await _serve(request, engine, model, body, params,
                            lambda: [engine.submit(prompt, params, priority=body.priority,
                                                   add_special_tokens=body.add_special_tokens,
                                                   cache_salt=body.cache_salt)
                                     for prompt in prompts],
                            chat=False, logprobs=body.logprobs, durable=durable)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model.check(body.model)
        params = body.to_sampling_params(engine.default_sampling)
        prompt = engine.render_chat(body.conversation(), tools=body.template_tools(),
                                    chat_template_kwargs=body.chat_template_kwargs)
        structured = params.structured_outputs
        parser = chat_parsing.for_request(body, template_supports_tools(engine.tokenizer),
                                          prompt, structured=structured is not None)
        if parser.reads_special_tokens:  # the parsers read markers that are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        if structured is not None and parser.reasoning is not None:
            # The model thinks first; the grammar starts once the thinking ends.
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                structured, start_after=parser.reasoning.end))
        return await _serve(request, engine, model, body, params,
                            lambda: [engine.submit(prompt, params, priority=body.priority,
                                                   add_special_tokens=body.add_special_tokens,
                                                   cache_salt=body.cache_salt)],
                            chat=True,
                            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                            chat_parser=parser, durable=durable)

    return router


def _named_for_client(error: ValueError, body: SamplingFields) -> ValueError | APIError:
    """Engine errors name the engine's knob; name the request field the client sent."""
    message = str(error)
    if message.startswith("prompt:") and isinstance(body, ChatCompletionRequest):
        # The client sent no prompt: the message names the field it did send.
        detail = message.removeprefix("prompt:").strip()
        return APIError(400, f"messages (as the rendered prompt): {detail}", param="messages")
    field = body.structured_field
    if field is None and isinstance(body, ChatCompletionRequest) and body.tools:
        field = "tools"  # the forced call's schema is the tools' parameters
    if field and message.startswith("structured_outputs"):
        detail = message.split(":", 1)[1].strip()
        return APIError(400, f"{field}: {detail}", param=field)
    return error


async def _serve(request: Request, engine: EngineView, model: ServedModel,
                 body: SamplingFields, params: SamplingParams | BeamSearchParams, submit,
                 chat: bool,
                 logprobs: int | None, chat_parser: ChatOutputParser = ChatOutputParser(),
                 durable: Callable[[], object] | None = None):
    """Submit, wait until the engine accepted every request (400 if not), then answer."""
    if engine.is_reconfiguring:
        raise APIError(503, "the engine is rebuilding its KV cache; retry shortly",
                       code="reconfiguring", headers={"Retry-After": str(RETRY_AFTER_S)})
    streams: list[RequestStream] = submit()
    generation = Generation(chat, f"{'chatcmpl' if chat else 'cmpl'}-{streams[0].request_id}",
                            model.name, streams, body.n, engine.tokenizer, logprobs,
                            body.include_usage, echo=getattr(body, "echo", False),
                            prompt_logprobs=getattr(body, "prompt_logprobs", None) is not None,
                            chat_parser=chat_parser, durable=durable)
    try:
        await asyncio.gather(*(s.accepted() for s in streams))
    except BaseException as error:
        generation.abort_unfinished()
        if isinstance(error, ValueError):
            raise _named_for_client(error, body) from error
        raise
    if body.stream:
        return StreamingResponse(generation.events(), media_type="text/event-stream")
    try:
        return JSONResponse(await _unless_disconnected(request, generation.response()))
    finally:
        generation.abort_unfinished()


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client hangs up first (its requests get aborted)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            logger.info("client disconnected; aborting its request")
            # Nobody reads this answer; nginx's 499 names the case in access logs.
            raise APIError(499, "client closed the request")
    return task.result()


def health_router(engine: EngineView) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        """200 while any replica serves ("degraded" if some are down), else 503."""
        counters = engine.counters()
        statuses = engine.replica_statuses()
        num_up = sum(status.alive for status in statuses)
        healthy = engine.is_running and num_up > 0
        status = ("ok" if num_up == len(statuses) else "degraded") if healthy else (
            "engine stopped")
        return JSONResponse(
            {"status": status,
             "step_failures": counters.step_failures,
             "reconfiguring": engine.is_reconfiguring,
             "num_steps": counters.num_steps,
             "replicas": [{"replica": s.replica, "alive": s.alive, "error": s.error,
                           "restarts": s.restarts, "in_flight": s.in_flight}
                          for s in statuses]},
            status_code=200 if healthy else 503)

    @router.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    return router
