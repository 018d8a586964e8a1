"""The chat tab's handler: multi-turn with the model's chat template, streamed."""

import time
import uuid

import gradio as gr

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.streams import RequestFailed
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving.reasoning.qwen3 import Qwen3ReasoningParser
from kvscope.ui.form_values import form_number

# Admission waits for the engine thread; during a reconfigure requests are held that long.
ACCEPT_TIMEOUT_S = 120


# The chat's own defaults, for what the model's generation_config leaves unset.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 128,
                 "repetition_penalty": 1.0, "min_p": 0.0}
# The Sampling accordion's fields, in chat_reply's order: (label, lowest, highest, step; a
# step of 1 takes whole numbers). Number fields, not sliders: a slider refuses a typed
# value outside its range in Gradio itself, a server traceback; chat_reply refuses it
# naming the field and its limits.
SAMPLING_FIELDS = {"temperature": ("temperature", 0, 2, 0.05),
                   "top_p": ("top-p", 0.05, 1, 0.05),
                   "max_tokens": ("max tokens", 1, 1024, 1),
                   "repetition_penalty": ("repetition penalty", 0.5, 2, 0.05),
                   "min_p": ("min-p", 0, 1, 0.01)}


def sampling_defaults(engine) -> tuple[dict, str]:
    """The Sampling accordion's starting values, and a line saying where they come from:
    the model's generation_config where it sets them (as vLLM does), else the chat's."""
    from_model = {k: v for k, v in engine.default_sampling.items() if k in CHAT_DEFAULTS}
    values = {**CHAT_DEFAULTS, **from_model}
    if from_model:
        listed = ", ".join(f"{k} {v}" for k, v in from_model.items())
        note = f"From the model's generation_config: {listed}. The rest are the chat's defaults."
    else:
        note = ("The model's generation_config sets no sampling defaults; these are the "
                "chat's.")
    return values, note


def has_thinking_switch(engine: EngineView) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3 and templates like it);
    other templates ignore the variable, so the toggle is shown only where it acts."""
    return "enable_thinking" in (engine.tokenizer.chat_template or "")


def new_conversation() -> dict:
    return {"id": uuid.uuid4().hex[:12], "messages": []}


def reply_stats(output: RequestOutput, first_text_s: float | None = None) -> str:
    """The line under a reply: latency, speed and how much of the prompt was cached.

    `first_text_s` is what the person waited: from the message reaching the server to the
    first text sent back, queueing for the engine thread and the chat template included;
    the engine's TTFT starts only once the engine has taken the request.
    """
    metrics = output.metrics
    tokens = len(output.outputs[0].token_ids)
    parts = []
    if first_text_s is not None:
        parts.append(f"first text after {first_text_s:.2f} s")
    if metrics and metrics.time_to_first_token is not None:
        parts.append(f"engine TTFT {metrics.time_to_first_token * 1000:.0f} ms")
        if metrics.finished_time and tokens > 1:
            decode_s = metrics.finished_time - metrics.first_token_time
            parts.append(f"{(tokens - 1) / decode_s:.1f} tok/s" if decode_s > 0 else "")
    parts.append(f"{len(output.prompt_token_ids)} prompt tokens "
                 f"({output.num_cached_tokens} cached)")
    parts.append(f"{tokens} output tokens, {output.outputs[0].finish_reason}")
    return " · ".join(part for part in parts if part)


# Thinking a reply opens with <think> itself (a template that opens it in the prompt
# leaves no marker in the reply, which then shows whole).
THINKING = Qwen3ReasoningParser()


def _display(messages: list[dict], stats: list[str]) -> list[dict]:
    """Chatbot messages: each finished reply carries its stats line underneath, and a
    reply's <think>...</think> is shown folded, apart from the answer."""
    shown, replies = [], iter(stats)
    for message in messages:
        content = message["content"]
        if message["role"] == "assistant":
            line = next(replies, "")
            split = THINKING.extract(content, final=bool(line))
            if split.reasoning:
                shown.append({"role": "assistant", "content": split.reasoning,
                              "metadata": {"title": "Reasoning",
                                           "status": "done" if split.ended else "pending"}})
                content = split.content
            content = f"{content}\n\n<sub>{line}</sub>" if line else content
        shown.append({"role": message["role"], "content": content})
    return shown


# While a reply streams the message box is the person's: a message sent then waits in
# it and goes when the reply ends (the event's trigger_mode is "always_last").
STREAMING_STATUS = ("generating… (a message you send now waits in the box and goes when "
                    "this reply ends)")


def chat_reply(engine: EngineView, session_log, message: str, conversation: dict,
               temperature: float, top_p: float, max_tokens: int,
               repetition_penalty: float = 1.0, min_p: float = 0.0, thinking: bool = True):
    """Yields (chatbot, conversation, textbox, status). Bad input warns and changes nothing.
    The textbox is emptied once, when the message is taken; later yields leave it alone
    (gr.skip()), so what the person types during the reply is kept."""
    received = time.monotonic()
    conversation = conversation or new_conversation()
    stats = list(conversation.get("stats", []))
    unchanged = (_display(conversation["messages"], stats), conversation, message)
    if not message or not message.strip():
        gr.Warning("Type a message first.")
        yield *unchanged, "Type a message first."
        return
    messages = [*conversation["messages"], {"role": "user", "content": message}]
    try:
        typed = (temperature, top_p, max_tokens, repetition_penalty, min_p)
        params = SamplingParams(**{
            name: form_number(label, value, integer=step == 1, low=low, high=high)
            for (name, (label, low, high, step)), value in zip(SAMPLING_FIELDS.items(), typed)})
        stream = engine.submit_chat(messages, params, source="chat",
                                    chat_template_kwargs={"enable_thinking": bool(thinking)})
        # A conversation longer than max_model_len is refused here, naming both numbers.
        stream.wait_accepted(timeout=ACCEPT_TIMEOUT_S)
    except (ValueError, TimeoutError) as error:
        gr.Warning(str(error))
        yield *unchanged, f"Refused: {error}"
        return
    text, output, first_text_s = "", None, None
    # The request of each reply, the streaming one's too: a click on a turn follows it.
    requests = [*conversation.get("requests", []), stream.request_id]
    conversation = {**conversation, "requests": requests}
    yield _display(messages, stats), conversation, "", STREAMING_STATUS  # taken: box emptied
    try:
        for output in stream:
            text += output.deltas[0] if output.deltas else ""
            if first_text_s is None and text:
                first_text_s = time.monotonic() - received
            partial = [*messages, {"role": "assistant", "content": text}]
            yield _display(partial, stats), conversation, gr.skip(), STREAMING_STATUS
    except RequestFailed as error:
        gr.Warning(str(error))
        yield _display(messages, stats), conversation, gr.skip(), f"Generation failed: {error}"
        return
    finally:
        stream.abort()  # a no-op once finished; else the browser left or pressed stop
    line = reply_stats(output, first_text_s)
    conversation = {"id": conversation["id"], "stats": [*stats, line], "requests": requests,
                    "messages": [*messages, {"role": "assistant", "content": text}]}
    if session_log is not None:  # the request itself is logged by storage.record_sessions
        session_log.record_chat_message(conversation["id"], "user", message)
        session_log.record_chat_message(conversation["id"], "assistant", text,
                                        request_id=output.request_id)
    yield (_display(conversation["messages"], conversation["stats"]), conversation, gr.skip(),
           line)


def turn_request(shown: list, conversation: dict, index) -> str:
    """The request id behind a clicked chat message (`index` into the chatbot's shown
    messages, as its select event gives it): an assistant reply's own request, a user
    message's reply's; "" where there is none (yet)."""
    index = index[0] if isinstance(index, (list, tuple)) else int(index)
    turns, reply = [], 0  # per shown message, the reply it belongs to
    for message in shown:
        role = message["role"] if isinstance(message, dict) else message.role
        metadata = (message.get("metadata") if isinstance(message, dict)
                    else message.metadata) or {}
        turns.append(reply)
        # A reply is its folded reasoning (titled) and then its answer, which ends it.
        reply += role == "assistant" and not metadata.get("title")
    requests = (conversation or {}).get("requests", [])
    turn = turns[index] if 0 <= index < len(turns) else len(requests)
    return requests[turn] if turn < len(requests) else ""


def follow_turn(shown: list, conversation: dict, event: gr.SelectData):
    """A click on a chat message: the "follow request" field gets its request."""
    return turn_request(shown, conversation, event.index) or gr.skip()
