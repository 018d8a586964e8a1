"""Tool calling and reasoning as vLLM serves them: the parsers on text (a tiny random
model writes no calls of its own), and the openai client's tool loop against a live server
where the calls are grammar-forced (tool_choice "required" or a named function)."""

import json

import jsonschema
import openai
import pytest
from conftest import serve
from tool_models import save_tiny_tools_model

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.orchestrator.chat import template_supports_tools
from kvscope.engine.serving import create_app
from kvscope.engine.serving.chat_output import ChatDeltaStream, ChatOutputParser
from kvscope.engine.serving.chat_parsing import ChatParsing
from kvscope.engine.serving.errors import APIError
from kvscope.engine.serving.protocol import ChatCompletionRequest
from kvscope.engine.serving.reasoning import REASONING_PARSERS
from kvscope.engine.serving.tool_parsers import TOOL_PARSERS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


# ---- the parsers, on text ---------------------------------------------------------------
QWEN3_ANSWER = ('<think>The user wants weather.</think>\n\nLet me check. <tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                '</tool_call>')


def streamed(parser: ChatOutputParser, text: str) -> dict:
    """Feed `text` one character at a time, as a stream would; join the deltas."""
    stream = ChatDeltaStream(parser)
    joined = {"reasoning_content": "", "content": "", "tool_calls": []}
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], final=end == len(text))
        for key in ("reasoning_content", "content"):
            joined[key] += delta.get(key, "")
        joined["tool_calls"] += delta.get("tool_calls", [])
    return joined


def test_hermes_and_qwen3_split_thinking_answer_and_calls_whole_or_streamed():
    parser = ChatOutputParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
    message = parser.message(QWEN3_ANSWER)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "\n\nLet me check. "
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": 2})]
    assert parser.finish_reason(QWEN3_ANSWER, "stop") == "tool_calls"
    joined = streamed(parser, QWEN3_ANSWER)
    assert joined["reasoning_content"] == message["reasoning_content"]
    assert joined["content"] == message["content"]
    assert [c["index"] for c in joined["tool_calls"]] == [0, 1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in joined["tool_calls"]] == calls
    # No marker text ever leaked into a delta while it was arriving.
    assert "<" not in joined["content"] and "<" not in joined["reasoning_content"]


def test_hermes_keeps_a_malformed_call_as_content():
    text = 'a<tool_call>{"name": oops}</tool_call>b'
    parsed = ChatOutputParser(tools=TOOL_PARSERS["hermes"]()).parse(text, final=True)
    assert parsed.calls == [] and parsed.content == 'a<tool_call>{"name": oops}</tool_call>'
    assert streamed(ChatOutputParser(tools=TOOL_PARSERS["hermes"]()), text)["content"] == (
        parsed.content)


@pytest.mark.parametrize("text, content, names", [
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}', "",
     ["add", "get_weather"]),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "", ["add"]),
    ("The answer is 3.", "The answer is 3.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_llama3_json_calls_or_content(text, content, names):
    parser = ChatOutputParser(tools=TOOL_PARSERS["llama3_json"]())
    parsed = parser.parse(text, final=True)
    assert parsed.content == content and [c.name for c in parsed.calls] == names
    joined = streamed(parser, text)
    assert joined["content"] == content
    assert [c["function"]["name"] for c in joined["tool_calls"]] == names


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>hmm</think>ok", "hmm", "ok"),
    ("qwen3", "no thinking at all", "", "no thinking at all"),  # enable_thinking=False
    ("deepseek_r1", "hmm</think>ok", "hmm", "ok"),  # the template opened <think>
    ("deepseek_r1", "<think>hmm</think>ok", "hmm", "ok"),
    ("deepseek_r1", "still thinking, cut by max_tokens", "still thinking, cut by max_tokens",
     ""),
])
def test_reasoning_parsers(name, text, reasoning, content):
    parser = ChatOutputParser(REASONING_PARSERS[name]())
    parsed = parser.parse(text, final=True)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    joined = streamed(parser, text)
    assert (joined["reasoning_content"], joined["content"]) == (reasoning, content)


def test_auto_needs_the_flags_and_a_template_with_tools(tiny_chat_model_path, tools_model_path):
    from transformers import AutoTokenizer
    assert not template_supports_tools(AutoTokenizer.from_pretrained(tiny_chat_model_path))
    assert template_supports_tools(AutoTokenizer.from_pretrained(tools_model_path))
    body = ChatCompletionRequest(messages=QUESTION, tools=[WEATHER])
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as refused:
        ChatParsing().for_request(body, template_has_tools=True)
    assert refused.value.param == "tools"  # tools alone: tool_choice "auto"
    auto = ChatParsing(enable_auto_tool_choice=True, tool_call_parser="hermes")
    explicit = ChatCompletionRequest(messages=QUESTION, tools=[WEATHER], tool_choice="auto")
    with pytest.raises(APIError, match="template") as refused:
        auto.for_request(explicit, template_has_tools=False)
    assert (refused.value.status_code, refused.value.param) == (400, "tool_choice")
    # Forced calls need no template support: the grammar writes them.
    required = ChatCompletionRequest(messages=QUESTION, tools=[WEATHER], tool_choice="required")
    assert auto.for_request(required, template_has_tools=False).tools is not None
    with pytest.raises(ValueError, match="tool_call_parser='nope'"):
        ChatParsing(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatParsing(reasoning_parser="o1")


# ---- a live server and the openai client -------------------------------------------------
@pytest.fixture(scope="module")
def tools_model_path(tmp_path_factory):
    return save_tiny_tools_model(tmp_path_factory.mktemp("tiny-tools-llama"))


@pytest.fixture(scope="module")
def client(tools_model_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tools_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=512, max_model_len=2048, max_num_batched_tokens=2048)).start()
    parsing = ChatParsing(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="qwen3")
    url, server, thread = serve(create_app(engine, chat_parsing=parsing))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def valid_calls(tool_calls) -> list[tuple[str, dict]]:
    calls = []
    for call in tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def accumulated_tool_calls(stream) -> tuple[list[dict], str | None]:
    """The openai client's streamed tool-call deltas, merged by index as agents do."""
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return [calls[index] for index in sorted(calls)], finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_loop_call_result_answer(client, stream):
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": model, "messages": QUESTION, "tools": TOOLS, "tool_choice": named,
               "max_tokens": 64, "temperature": 0}
    if stream:
        calls, finish_reason = accumulated_tool_calls(
            client.chat.completions.create(**request, stream=True))
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
        assert len(calls) == 1
    else:
        choice = client.chat.completions.create(**request).choices[0]
        finish_reason, (call,) = choice.finish_reason, choice.message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish_reason == "stop"  # OpenAI's for a named function
    assert name == "get_weather" and call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
    # The call and its result go back through the template; the model answers in text.
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > len("<tool_response>\n18 degrees, sunny")
    assert answer.choices[0].message.content  # no thinking opened: all answer


def test_required_calls_parse_and_validate_streamed_or_not(client):
    model = client.models.list().data[0].id
    request = {"model": model, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
               "max_tokens": 200, "temperature": 0.8, "seed": 3}
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert valid_calls(whole.message.tool_calls)
    calls, finish_reason = accumulated_tool_calls(
        client.chat.completions.create(**request, stream=True))
    assert finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == valid_calls(
        whole.message.tool_calls)  # same seed, same calls
    single = client.chat.completions.create(**request, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_choice_errors_name_the_field(client):
    model = client.models.list().data[0].id
    for extra, param in (({"tool_choice": "required"}, "tool_choice"),  # no tools
                         ({"tools": [WEATHER], "tool_choice": {
                             "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=QUESTION, **extra)
        assert refused.value.body["param"] == param


def test_reasoning_content_streamed_equals_whole(client):
    """enable_thinking reaches the template, which opens <think> in the prompt: the
    random model never closes it, so all of its answer is thinking."""
    model = client.models.list().data[0].id
    request = {"model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
               "extra_body": {"ignore_eos": True,
                              "chat_template_kwargs": {"enable_thinking": True}}}
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content is None or message.content == ""
    reasoning = "".join(getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                        for chunk in client.chat.completions.create(**request, stream=True)
                        if chunk.choices)
    assert reasoning == message.reasoning_content and reasoning
    # Without the switch the prompt opens no thinking block: all of it is the answer.
    del request["extra_body"]["chat_template_kwargs"]
    plain = client.chat.completions.create(**request).choices[0].message
    assert plain.reasoning_content is None and plain.content


def test_a_schema_waits_for_the_thinking_to_end(client):
    """With thinking opened in the prompt, response_format starts after </think> (as in
    vLLM): the random model never ends its thinking, so nothing is held to the schema."""
    model = client.models.list().data[0].id
    message = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=10, temperature=0,
        response_format={"type": "json_object"},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
    ).choices[0].message
    assert message.reasoning_content and not message.reasoning_content.startswith("{")


def test_dashboard_chat_folds_reasoning_apart_from_the_answer():
    from kvscope.ui.chat import _display
    user = {"role": "user", "content": "hi"}
    thinking = {"role": "assistant", "content": "<think>weighing it"}
    shown = _display([user, thinking], [])  # still streaming
    assert shown[1] == {"role": "assistant", "content": "weighing it",
                        "metadata": {"title": "Reasoning", "status": "pending"}}
    done = {"role": "assistant", "content": "<think>weighing it</think>Hello!"}
    shown = _display([user, done], ["12 tokens"])
    assert shown[1]["metadata"]["status"] == "done" and shown[1]["content"] == "weighing it"
    assert shown[2] == {"role": "assistant", "content": "Hello!\n\n<sub>12 tokens</sub>"}
    assert _display([user, {"role": "assistant", "content": "plain"}], []) == [
        user, {"role": "assistant", "content": "plain"}]


def test_dashboard_chat_thinking_toggle_reaches_the_template(tools_model_path):
    """The chat's "thinking" checkbox is chat_template_kwargs={"enable_thinking": ...}."""
    from kvscope.ui.chat import chat_reply, has_thinking_switch, new_conversation
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tools_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=512, max_num_batched_tokens=512)).start()
    try:
        assert has_thinking_switch(engine)
        feed = engine.subscribe_requests()
        prompts = {}
        for thinking in (False, True):
            for _ in chat_reply(engine, None, "hi", new_conversation(), 0.0, 1.0, 2,
                                thinking=thinking):
                pass
            prompts[thinking] = feed.get(timeout=30).output.prompt
        feed.close()
        assert prompts[False].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert prompts[True].endswith("<|im_start|>assistant\n<think>\n")
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def offline_llm(tools_model_path):
    from kvscope import LLM
    return LLM(str(tools_model_path), dtype="float32", device="cpu",
               num_gpu_blocks_override=64, max_model_len=1024)


def test_llm_chat_passes_tools_and_template_kwargs(offline_llm):
    from kvscope import SamplingParams
    output, = offline_llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False,
                               chat_template_kwargs={"enable_thinking": False}, tools=[ADD])
    assert output.prompt.endswith("<think>\n\n</think>\n\n")
    assert '"name": "add"' in output.prompt


def test_structured_output_starts_after_the_reasoning_ends(offline_llm):
    from kvscope import SamplingParams
    from kvscope.engine.sampling_params import StructuredOutputsParams
    llm = offline_llm
    z = llm.engine.tokenizer.convert_tokens_to_ids("z")
    params = [SamplingParams(
        max_tokens=60, temperature=1.0, seed=seed, logit_bias={z: 4.0},
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"], start_after="z"))
        for seed in range(6)]
    texts = [o.outputs[0].text for o in llm.generate(["hi"] * len(params), params,
                                                     use_tqdm=False)]
    for text in texts:  # free text, the marker, then only what the grammar allows
        assert "z" in text and text.split("z", 1)[1] in ("yes", "no"), text
    assert any(text.index("z") > 0 for text in texts)  # some thought before the marker


# ---- gpt-oss's harmony format: `openai_gptoss` reasoning, `openai` calls -----------------
HARMONY_THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
HARMONY_ANSWER = (HARMONY_THINK + "<|start|>assistant<|channel|>final<|message|>"
                  "It is sunny in Paris.<|return|>")
HARMONY_CALLS = (
    HARMONY_THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris",\n "unit": "C"}<|call|>'
    '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}'
    "<|call|>")


def harmony_parser() -> ChatOutputParser:
    return ChatOutputParser(REASONING_PARSERS["openai_gptoss"](), TOOL_PARSERS["openai"]())


@pytest.mark.parametrize("parser", [
    pytest.param(harmony_parser(), id="reasoning-and-tool-parser"),
    pytest.param(ChatOutputParser(REASONING_PARSERS["openai_gptoss"]()), id="reasoning-parser"),
])
def test_harmony_analysis_is_reasoning_final_is_content(parser):
    assert parser.reads_special_tokens
    message = parser.message(HARMONY_ANSWER)
    assert (message["reasoning_content"], message["content"]) == (
        "The user wants the weather.", "It is sunny in Paris.")
    assert "tool_calls" not in message
    assert parser.finish_reason(HARMONY_ANSWER, "stop") == "stop"
    joined = streamed(parser, HARMONY_ANSWER)
    assert (joined["reasoning_content"], joined["content"]) == (
        message["reasoning_content"], message["content"])


def test_harmony_calls_to_functions_are_tool_calls_preambles_are_content():
    """Calls name their function before or after the channel, with `json` alone or after
    `<|constrain|>`; the arguments are re-encoded JSON; a preamble (commentary to nobody)
    is content."""
    parser = harmony_parser()
    message = parser.message(HARMONY_CALLS)
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Checking."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", '{"city": "Paris", "unit": "C"}'),
                     ("add", '{"a": 1, "b": 2}')]
    assert parser.finish_reason(HARMONY_CALLS, "stop") == "tool_calls"
    joined = streamed(parser, HARMONY_CALLS)
    assert (joined["reasoning_content"], joined["content"]) == ("The user wants the weather.",
                                                                "Checking.")
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"])
            for c in joined["tool_calls"]] == [(i, *call) for i, call in enumerate(calls)]
    # Only the calls: the reasoning parser alone leaves them out of the content.
    alone = ChatOutputParser(REASONING_PARSERS["openai_gptoss"]()).message(HARMONY_CALLS)
    assert alone["content"] == "Checking." and "tool_calls" not in alone


@pytest.mark.parametrize("text, reasoning, content, arguments", [
    pytest.param("<|channel|>analysis<|message|>cut by max_tok", "cut by max_tok", "", None,
                 id="cut-in-the-reasoning"),
    pytest.param("<|channel|>final<|message|>no thinking", "", "no thinking", None,
                 id="answer-without-reasoning"),
    pytest.param("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis"
                 "<|message|>b<|end|><|start|>assistant<|channel|>fi", "a\nb", "", None,
                 id="two-analysis-messages-then-an-unfinished-header"),
    pytest.param("<|channel|>commentary to=functions.add <|constrain|>json<|message|>{oops"
                 "<|call|>", "", "", "{oops", id="arguments-that-are-not-json-as-written"),
    pytest.param("<|channel|>commentary to=functions.add code<|message|>print(1)<|call|>", "",
                 "", "print(1)", id="arguments-of-another-type-as-written"),
])
def test_harmony_partial_and_odd_outputs(text, reasoning, content, arguments):
    parsed = harmony_parser().parse(text, final=True)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    assert [call.arguments for call in parsed.calls] == ([arguments] if arguments else [])


# A user's question, its call, and the answer once the call's result came back: the tiny
# scripted model writes each (tests/harmony_models.py).
HARMONY_QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                '<|constrain|>json<|message|>{"city": "Paris", "unit": "C"}<|call|>')
HARMONY_RESULT = "18 degrees, sunny"
HARMONY_AFTER_RESULT = ("<|channel|>analysis<|message|>The tool said 18.<|end|>"
                        "<|start|>assistant<|channel|>final<|message|>18 C and sunny.<|return|>")


def harmony_conversation(call_id: str = "call-0") -> list[dict]:
    return [*HARMONY_QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": HARMONY_RESULT}]


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    from harmony_models import save_harmony_tokenizer, save_scripted_model

    from kvscope.engine.orchestrator.chat import render_chat
    folder = tmp_path_factory.mktemp("tiny-harmony")
    tokenizer = save_harmony_tokenizer(folder)
    scripts = []
    for messages, tools, answer in ((HARMONY_QUESTION, None, HARMONY_ANSWER),
                                    (HARMONY_QUESTION, [WEATHER], HARMONY_CALL),
                                    (harmony_conversation(), [WEATHER], HARMONY_AFTER_RESULT)):
        body = ChatCompletionRequest(messages=messages, tools=tools)  # as the server reads it
        scripts.append((render_chat(tokenizer, body.conversation(), tools=body.template_tools()),
                        answer))
    save_scripted_model(folder, tokenizer, scripts)
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(folder), dtype="float32", device="cpu", block_size=16,
        num_gpu_blocks_override=256, max_model_len=2048, max_num_batched_tokens=2048)).start()
    parsing = ChatParsing(enable_auto_tool_choice=True, tool_call_parser="openai",
                          reasoning_parser="openai_gptoss")
    url, server, thread = serve(create_app(engine, chat_parsing=parsing))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_harmony_reasoning_and_answer(harmony_client, stream):
    model = harmony_client.models.list().data[0].id
    request = {"model": model, "messages": HARMONY_QUESTION, "max_tokens": 200,
               "temperature": 0}
    if not stream:
        choice = harmony_client.chat.completions.create(**request).choices[0]
        reasoning, content = choice.message.reasoning_content, choice.message.content
        finish_reason = choice.finish_reason
    else:
        reasoning = content = ""
        for chunk in harmony_client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                finish_reason = choice.finish_reason or None
    assert (reasoning, content) == ("The user wants the weather.", "It is sunny in Paris.")
    assert finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_harmony_tool_loop(harmony_client, stream):
    """The model calls get_weather on the commentary channel; the call and its result go
    back through the template, and the model answers on the final channel."""
    model = harmony_client.models.list().data[0].id
    request = {"model": model, "messages": HARMONY_QUESTION, "tools": [WEATHER],
               "max_tokens": 200, "temperature": 0}
    if stream:
        calls, finish_reason = accumulated_tool_calls(
            harmony_client.chat.completions.create(**request, stream=True))
        name, arguments, call_id = calls[0]["name"], calls[0]["arguments"], calls[0]["id"]
        assert len(calls) == 1
    else:
        choice = harmony_client.chat.completions.create(**request).choices[0]
        assert choice.message.reasoning_content == "Need the weather tool."
        assert choice.message.content is None
        (call,), finish_reason = choice.message.tool_calls, choice.finish_reason
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    assert finish_reason == "tool_calls"
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris", "unit": "C"})
    answer = harmony_client.chat.completions.create(
        model=model, messages=harmony_conversation(call_id), tools=[WEATHER], max_tokens=200,
        temperature=0).choices[0]
    assert (answer.message.reasoning_content, answer.message.content) == (
        "The tool said 18.", "18 C and sunny.")
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
