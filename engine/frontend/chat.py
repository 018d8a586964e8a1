"""Chat templates, applied in one place for the offline API, the server and the dashboard."""

from typing import Any


def render_chat(tokenizer, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (by default ending with the assistant's turn).

    The template holds the special tokens, so the text is tokenized without adding a BOS.
    """
    if not messages:
        raise ValueError("messages: give at least one message")
    if tokenizer.chat_template is None:
        raise ValueError("messages: the model has no chat template; use completions")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja raises its own types for malformed messages
        raise ValueError(f"messages: the chat template failed: {error}") from error
