"""/tokenize and /detokenize with vLLM's request and response shapes (a prompt, or chat
messages through the template; under the API key like every route but /health)."""

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.serving.protocol import ChatMessage, ChatTool, tools_for_template
from kvscope.engine.serving.routes import ServedModel


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template holds the special tokens
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenization_router(engine: EngineView, model: ServedModel) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict:
        model.check(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = engine.render_chat(
                [message.as_template_input() for message in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                tools=tools_for_template(body.tools),
                chat_template_kwargs=body.chat_template_kwargs)
        else:
            text = body.prompt
        tokenizer = engine.tokenizer
        tokens = tokenizer(text, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"count": len(tokens), "max_model_len": engine.config.max_model_len,
                "tokens": tokens,
                "token_strs": (tokenizer.convert_ids_to_tokens(tokens)
                               if body.return_token_strs else None)}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        model.check(body.model)
        vocab_size = len(engine.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < vocab_size]
        if bad:
            raise ValueError(f"tokens: {bad[0]} is not a token id (0 <= id < {vocab_size})")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return router
