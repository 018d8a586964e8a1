"""Every request field of OpenAI's API and of vLLM's extensions, sent by the real `openai`
client: each is honoured (a check proves it changed the answer as it should), a
documented no-op, or refused with a 400 naming it. None is silently ignored."""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from test_serving import LiveServer, api_served, assert_idle
from tokenizers import pre_tokenizers

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"], "additionalProperties": False}
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def server(tiny_byte_level_model_path) -> LiveServer:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_byte_level_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=256, max_model_len=256, max_num_batched_tokens=512)).start()
    with api_served(engine) as server:
        yield server
    engine.shutdown()


@dataclass
class Seen:
    """What a check compares against: the answer without the field (same other fields),
    the plain greedy answer, a way to send the very same request again, and the prompt's
    token count with or without the tokenizer's special tokens."""

    without: dict
    plain: dict
    again: Callable[[], dict]
    prompt_tokens: Callable[[bool], int]


Check = Callable[[dict, Seen], object]  # truthy when the field did what it says


@dataclass(frozen=True)
class Case:
    value: object
    kind: str  # "honoured", "no-op" or "refused"
    check: Check | None = None
    extra: tuple = ()  # other fields the case needs, as (name, value) pairs


def text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def tokens(answer: dict) -> int:
    return answer["usage"]["completion_tokens"]


def honoured(check: Check, *extra) -> Callable[[object], Case]:
    return lambda value: Case(value, "honoured", check, extra)


def refused(value) -> Case:
    return Case(value, "refused")


def no_op(value) -> Case:
    return Case(value, "no-op")


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def byte_token(character: str) -> int:
    """The byte-level test tokenizer: 3 special tokens, then GPT-2's 256 symbols, sorted."""
    return 3 + sorted(pre_tokenizers.ByteLevel.alphabet()).index(character)


def differs(answer: dict, seen: Seen) -> bool:
    return text(answer) != text(seen.without)


def greedy(answer: dict, seen: Seen) -> bool:
    """Sampling at temperature 1 that the field narrows to the single likeliest token."""
    return text(answer) == text(seen.plain) and text(seen.without) != text(seen.plain)


def matches_schema(answer: dict, seen: Seen) -> bool:
    jsonschema.validate(json.loads(text(answer)), SCHEMA)
    return True


EOS_FIRST = ("logit_bias", {"2": 100})  # the model's EOS (token 2) always likeliest
HOT = ("temperature", 1.0)
Z = str(byte_token("z"))
# The random model's logits span ~0.3: a small bias makes it repeat "z" until penalised.
REPEATS_Z = ("logit_bias", {Z: 0.5})
SHARED = {  # fields both routes take
    "model": no_op(None),  # the served name (a wrong one is a 404, see test_serving)
    "frequency_penalty": honoured(differs, REPEATS_Z)(2.0),
    "presence_penalty": honoured(differs, REPEATS_Z)(2.0),
    "logit_bias": honoured(lambda a, seen: set(text(a)) == {"z"})({Z: 100}),
    "max_tokens": honoured(lambda a, seen: tokens(a) == 3)(3),
    "n": honoured(lambda a, seen: len(a["choices"]) == 3, HOT)(3),
    "seed": honoured(lambda a, seen: a["choices"] == seen.again()["choices"], HOT)(7),
    "stop": honoured(lambda a, seen: text(a) == text(seen.without)[:3]
                     and a["choices"][0]["finish_reason"] == "stop")(None),
    "stream_options": refused({"include_usage": True}),  # only with stream=true
    "temperature": honoured(differs)(1.5),
    "top_p": honoured(greedy, HOT)(1e-6),
    "user": no_op("someone"),
    "response_format": honoured(matches_schema, ("max_tokens", 80))(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    # vLLM's extensions (the openai client sends them with extra_body)
    "top_k": honoured(greedy, HOT)(1),
    "min_p": honoured(greedy, HOT)(1.0),
    "repetition_penalty": honoured(differs, REPEATS_Z)(3.0),
    "stop_token_ids": honoured(lambda a, seen: tokens(a) == 1 and tokens(seen.without) == 8,
                               ("logit_bias", {Z: 100}))([byte_token("z")]),
    "ignore_eos": honoured(lambda a, seen: tokens(a) == 8 and tokens(seen.without) == 1,
                           EOS_FIRST, ("ignore_eos", False))(True),
    "min_tokens": honoured(lambda a, seen: tokens(a) == 6 and tokens(seen.without) == 1,
                           EOS_FIRST, ("ignore_eos", False))(5),
    "skip_special_tokens": honoured(lambda a, seen: "<|im_start|>" in text(a)
                                    and not text(seen.without),
                                    ("logit_bias", {"1": 100}))(False),
    "truncate_prompt_tokens": honoured(lambda a, seen: a["usage"]["prompt_tokens"] == 2)(2),
    "allowed_token_ids": honoured(lambda a, seen: set(text(a)) <= set("ab"), HOT)(
        [byte_token("a"), byte_token("b")]),
    "bad_words": honoured(lambda a, seen: "z" not in text(a) and "z" in text(seen.without),
                          ("logit_bias", {Z: 100}))(["z"]),
    "guided_json": honoured(matches_schema, ("max_tokens", 80))(SCHEMA),
    "guided_regex": honoured(lambda a, seen: re.fullmatch(r"[0-9]{3}", text(a)))(r"[0-9]{3}"),
    "guided_choice": honoured(lambda a, seen: text(a) in ("red", "blue"))(["red", "blue"]),
    "guided_grammar": honoured(lambda a, seen: re.fullmatch(r"[xy]{2}z", text(a)))(
        "start: /[xy]{2}z/"),
    "structured_outputs": honoured(lambda a, seen: text(a) in ("up", "down"))(
        {"choice": ["up", "down"]}),
    "add_special_tokens": honoured(lambda a, seen: a["usage"]["prompt_tokens"]
                                   == seen.prompt_tokens(True))(True),
    "guided_decoding_backend": no_op("xgrammar"),  # one backend: llguidance
    "include_stop_str_in_output": refused(True),
    "spaces_between_special_tokens": refused(False),
    "use_beam_search": refused(True),
    "length_penalty": refused(0.5),
    "priority": refused(3),
    "logits_processors": refused(["my.processor"]),
    "return_tokens_as_token_ids": refused(True),
    "return_token_ids": refused(True),
    "request_id": refused("mine"),
    # The unsalted prompt's blocks are cached (the plain request ran first): salted, it
    # shares none of them, and answers the same.
    "cache_salt": honoured(lambda a, seen: cached(a) == 0 < cached(seen.without)
                           and text(a) == text(seen.without))("salt"),
    "kv_transfer_params": refused({"a": 1}),
    "vllm_xargs": refused({"a": 1}),
    "guided_whitespace_pattern": refused(" *"),
}
COMPLETIONS = {
    "prompt": no_op(PROMPT),
    "echo": honoured(lambda a, seen: text(a) == PROMPT + text(seen.without))(True),
    "best_of": honoured(lambda a, seen: len(a["choices"]) == 1, HOT)(4),
    "logprobs": honoured(lambda a, seen: len(a["choices"][0]["logprobs"]["tokens"]) == 8)(2),
    "prompt_logprobs": honoured(lambda a, seen: len(a["choices"][0]["prompt_logprobs"])
                                == len(PROMPT))(1),
    "suffix": refused("!"),
    "prompt_embeds": refused("AAAA"),
    # Two distinct beams, where greedy samples (the same request without it) are equal.
    "use_beam_search": honoured(
        lambda a, seen: [c["index"] for c in a["choices"]] == [0, 1]
        and a["choices"][0]["text"] != a["choices"][1]["text"]
        and seen.without["choices"][0]["text"] == seen.without["choices"][1]["text"],
        ("n", 2), ("best_of", 3))(True),
}
CHAT = {
    "messages": no_op([{"role": "user", "content": PROMPT}]),
    "max_completion_tokens": honoured(lambda a, seen: tokens(a) == 2)(2),
    "logprobs": honoured(lambda a, seen: len(a["choices"][0]["logprobs"]["content"]) == 8)(
        True),
    "top_logprobs": honoured(lambda a, seen: len(
        a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3, ("logprobs", True))(3),
    "metadata": no_op({"team": "x"}),
    "store": refused(True),
    "service_tier": refused("flex"),
    "safety_identifier": no_op("abc"),
    "prompt_cache_key": no_op("k"),
    "prompt_cache_options": refused({"x": 1}),
    "prompt_cache_retention": refused("24h"),
    "parallel_tool_calls": no_op(False),
    "tool_choice": refused("required"),
    "tools": refused([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "functions": refused([{"name": "f", "parameters": {}}]),
    "function_call": refused("auto"),
    "audio": refused({"voice": "alloy", "format": "wav"}),
    "modalities": refused(["text", "audio"]),
    "moderation": refused({"x": 1}),
    "prediction": refused({"type": "content", "content": "x"}),
    "reasoning_effort": refused("high"),
    "verbosity": refused("low"),
    "web_search_options": refused({}),
    "echo": refused(True),
    "add_generation_prompt": refused(False),
    "continue_final_message": refused(True),
    "chat_template": refused("{{ messages }}"),
    "chat_template_kwargs": no_op({"enable_thinking": True}),  # a template without it
    "documents": refused([{"text": "x"}]),
    "mm_processor_kwargs": refused({"x": 1}),
    "prompt_logprobs": honoured(lambda a, seen: len(a["prompt_logprobs"])
                                == a["usage"]["prompt_tokens"])(1),
}
OPENAI_FIELDS = {
    "completions": set(completion_create_params.CompletionCreateParamsBase.__annotations__),
    "chat": set(chat_create_params.CompletionCreateParamsBase.__annotations__),
}


def cases(route: str) -> dict[str, Case]:
    return {**SHARED, **(COMPLETIONS if route == "completions" else CHAT)}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_openai_field_is_classified(route):
    missing = OPENAI_FIELDS[route] - set(cases(route))
    assert not missing, f"fields of the openai client with no case here: {missing}"


def call(server: LiveServer, route: str, fields: dict) -> dict:
    """One non-streaming request through the openai client; OpenAI's own fields go as
    keyword arguments, the rest as extra_body (as vLLM users write them)."""
    client = server.client()
    known = OPENAI_FIELDS[route] | {"stream"}
    kwargs = {name: value for name, value in fields.items() if name in known}
    extra = {name: value for name, value in fields.items() if name not in known}
    create = client.completions.create if route == "completions" else \
        client.chat.completions.create
    return create(**kwargs, extra_body=extra).to_dict()


def base_request(route: str, server: LiveServer) -> dict:
    opening = {"prompt": PROMPT} if route == "completions" else {
        "messages": [{"role": "user", "content": PROMPT}]}
    return {"model": server.model, **opening, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_each_field_is_honoured_a_no_op_or_refused_by_name(server, route):
    base = base_request(route, server)
    plain = call(server, route, base)
    for name, case in cases(route).items():
        request = {**base, **dict(case.extra)}
        value = base[name] if case.value is None and name in base else case.value
        if name == "stop":
            value = text(plain)[3]
        try:
            answer = call(server, route, {**request, name: value})
        except openai.BadRequestError as error:
            assert case.kind == "refused", (name, error.body)
            assert error.body["param"] == name and name in error.body["message"], error.body
            continue
        assert case.kind != "refused", f"{name}={value!r} was accepted: {answer}"
        if case.kind == "honoured":
            seen = Seen(call(server, route, request), plain,
                        lambda: call(server, route, {**request, name: value}),
                        lambda special: prompt_tokens(server, request, special))
            assert case.check(answer, seen), (name, answer, seen.without)
    assert_idle(server)


def prompt_tokens(server: LiveServer, request: dict, special: bool) -> int:
    prompt = request.get("prompt") or server.engine.render_chat(request["messages"])
    return len(server.engine.tokenizer(prompt, add_special_tokens=special).input_ids)


def test_an_uncompilable_schema_is_a_400_naming_the_field_it_came_in(server):
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}}
    for route, field, value in [
            ("chat", "response_format", {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": bad}}),
            ("completions", "guided_json", bad),
            ("completions", "guided_regex", "(unclosed"),
            ("chat", "structured_outputs", {"json": bad}),
            ("chat", "response_format", {"type": "xml"})]:
        with pytest.raises(openai.BadRequestError) as refusal:
            call(server, route, {**base_request(route, server), field: value})
        assert refusal.value.body["param"] == field, refusal.value.body
        assert refusal.value.body["message"].startswith(field)
    with pytest.raises(openai.BadRequestError) as refusal:
        call(server, "chat", {**base_request("chat", server), "guided_regex": "a",
                              "guided_choice": ["b"]})
    assert refusal.value.body["param"] in ("guided_regex", "guided_choice")
    assert_idle(server)


def test_structured_output_streams_valid_json(server):
    client = server.client()
    chunks = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "json please"}],
        max_tokens=80, stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA}})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_echo_with_logprobs_scores_the_prompt_tokens_too(server):
    answer = call(server, "completions", {**base_request("completions", server), "echo": True,
                                          "logprobs": 1})
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 8
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"][:len(PROMPT)]) == PROMPT  # one token per character
    assert logprobs["text_offset"][len(PROMPT)] == len(PROMPT)


def test_prompt_logprobs_carry_vllms_rank_on_both_routes(server):
    """Per prompt position: the prompt token and its two likeliest alternatives, each with
    logprob, rank and decoded text. The alternatives rank 1 and 2; the prompt token ranks
    at its place among them, or beyond them. Chat puts the list on the response, and
    refuses the field with stream=true (a chat chunk has no place for it)."""
    chat_request = {**base_request("chat", server), "prompt_logprobs": 2}
    answers = [
        (call(server, "completions", {**base_request("completions", server),
                                      "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"],
         server.engine.tokenizer(PROMPT).input_ids),
        (call(server, "chat", chat_request)["prompt_logprobs"],
         server.engine.tokenizer(server.engine.render_chat(chat_request["messages"]),
                                 add_special_tokens=False).input_ids)]
    for entries, prompt_ids in answers:
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for entry, token in zip(entries[1:], prompt_ids[1:], strict=True):
            assert all(set(value) == {"logprob", "rank", "decoded_token"}
                       for value in entry.values())
            by_likelihood = sorted(entry.values(), key=lambda value: -value["logprob"])
            assert [value["rank"] for value in by_likelihood[:2]] == [1, 2]
            assert str(token) in entry
            if len(entry) == 3:  # the prompt token is not among the two likeliest
                assert entry[str(token)] is by_likelihood[2] and entry[str(token)]["rank"] > 2
    with pytest.raises(openai.BadRequestError) as refusal:
        list(server.client().chat.completions.create(
            model=server.model, messages=chat_request["messages"], stream=True,
            extra_body={"prompt_logprobs": 1}))
    assert refusal.value.body["param"] == "prompt_logprobs"
    assert_idle(server)


def test_best_of_cannot_stream(server):
    with pytest.raises(openai.BadRequestError) as refusal:
        list(server.client().completions.create(model=server.model, prompt=PROMPT,
                                                best_of=3, stream=True))
    assert refusal.value.body["param"] == "best_of"


def test_a_seed_past_64_bits_is_a_400_naming_seed(server):
    """Found by tests/fuzz: a seed past int64 reached torch.Generator ('Overflow when
    unpacking long long', a 400 naming no field)."""
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(openai.BadRequestError) as refusal:
            server.client().completions.create(model=server.model, prompt=PROMPT, seed=seed,
                                               max_tokens=2)
        assert refusal.value.body["param"] == "seed", refusal.value.body
        assert refusal.value.body["message"].startswith("seed="), refusal.value.body
    assert_idle(server)
