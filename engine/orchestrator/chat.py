"""Chat templates, applied in one place for the offline API, the server and the dashboard."""

from typing import Any

import jinja2
import jinja2.meta

# What render_chat passes the template itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_ARGUMENTS = ("messages", "tools", "add_generation_prompt",
                               "continue_final_message", "tokenize")


def render_chat(tokenizer, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, *,
                tools: list[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation (by default ending with the assistant's turn).

    `tools` (OpenAI's tool list) and `chat_template_kwargs` (e.g. Qwen3's
    `enable_thinking`) reach the template as variables. The template holds the special
    tokens, so the text is tokenized without adding a BOS.
    """
    if not messages:
        raise ValueError("messages: give at least one message")
    if tokenizer.chat_template is None:
        raise ValueError("messages: the model has no chat template; use completions")
    extra = dict(chat_template_kwargs or {})
    clashing = sorted(set(extra) & set(RESERVED_TEMPLATE_ARGUMENTS))
    if clashing:
        raise ValueError(f"chat_template_kwargs: {clashing[0]} is set by the request itself, "
                         "not through chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as error:  # jinja raises its own types for malformed messages
        raise ValueError(f"messages: the chat template failed: {error}") from error


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable (else tools given to it vanish)."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %})
        return "tools" in template
