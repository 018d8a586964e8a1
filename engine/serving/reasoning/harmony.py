"""gpt-oss's output in OpenAI's harmony format, read into its messages.

The chat template ends the prompt with `<|start|>assistant`, so the output is one or more
messages, each a header, `<|message|>`, a body and an end marker:

    <|channel|>analysis<|message|>The user asks...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>      (one line in the output)

A header names the message's channel (`analysis`: reasoning, `final`: the answer,
`commentary`: tool calls and preambles), its recipient (`to=functions.NAME`, before or after
the channel) and its content type (`json`, alone or after `<|constrain|>`). `<|end|>` ends
a message, `<|return|>` the answer, `<|call|>` a tool call. The markers are special tokens,
so the output must be detokenized with them (skip_special_tokens=False).
"""

from dataclasses import dataclass

from kvscope.engine.serving.reasoning.base import held_back

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
END_MARKERS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    channel: str | None
    recipient: str | None  # e.g. "functions.get_weather"
    content_type: str | None  # e.g. "json"
    body: str
    complete: bool  # its end marker came, or the output ended


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of the output so far. While it still grows (`final=False`) a message is
    listed once its header is complete, its body without a tail that may be the start of an
    end marker: so each message's body only ever grows. A header the output ended in is
    dropped."""
    messages = []
    position = 0
    while position < len(text):
        body_start = text.find(MESSAGE, position)
        if body_start < 0:
            break
        channel, recipient, content_type = _read_header(text[position:body_start])
        body_start += len(MESSAGE)
        end, marker = _first_end(text, body_start)
        if end < 0:
            body = text[body_start:]
            if not final:
                body = body[:len(body) - max(held_back(body, m) for m in END_MARKERS)]
            messages.append(HarmonyMessage(channel, recipient, content_type, body, final))
            break
        messages.append(HarmonyMessage(channel, recipient, content_type,
                                       text[body_start:end], True))
        position = end + len(marker)
    return messages


def _first_end(text: str, start: int) -> tuple[int, str]:
    found = [(index, marker) for marker in END_MARKERS
             if (index := text.find(marker, start)) >= 0]
    return min(found) if found else (-1, "")


def _read_header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of `<|start|>ROLE [to=R]<|channel|>C [to=R]
    [<|constrain|>]TYPE`, the first message's without `<|start|>ROLE` (the prompt wrote it);
    the role, always the assistant's here, is dropped."""
    role_part, _, channel_part = header.partition(CHANNEL)
    role_words = role_part.removeprefix(START).split()
    if header.startswith(START):
        role_words = role_words[1:]
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    channel = channel_words[0] if channel_words else None
    recipient = content_type = None
    for word in role_words + channel_words[1:]:
        if word.startswith("to="):
            recipient = word.removeprefix("to=")
        else:
            content_type = word
    return channel, recipient, content_type


def is_tool_call(message: HarmonyMessage) -> bool:
    return message.recipient is not None and message.recipient.startswith("functions.")


def visible_text(messages: list[HarmonyMessage]) -> str:
    """What the user reads: the final channel and the commentary messages to nobody (the
    preambles gpt-oss writes before its calls), one per line."""
    return "\n".join(m.body for m in messages
                     if m.channel == "final" or (m.channel == "commentary" and m.recipient is None))
