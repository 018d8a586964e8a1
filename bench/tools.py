"""Tool calling: `tool_choice="required"` over 4 tool schemas vs the same requests without
tools, on a served app.py (the default model unless --model).

N chat requests (32 by default) each offer 4 tools and must call at least one (the
structured-output engine holds the answer to the tools' schemas). They run concurrently
through the openai client, greedy, twice:

  tools     tool_choice="required": every answer is parsed into tool calls, and every call
            is checked against its tool's JSON schema
  no_tools  the same conversations without tools, each request generating exactly as many
            tokens as its twin did (ignore_eos), so both runs produce the same token count

Prints JSON: output tokens/s of both runs and their ratio (target >= 0.7), the same by the
server process's CPU time (steadier on a shared machine), and how many calls parsed and
validated (target: all).

Usage:
  python bench/tools.py
  python bench/tools.py --num-requests 16 --repeats 3 --threads 1
"""

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
from served import cpu_name, process_cpu_seconds, start_app, stop_app


def function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": sorted(properties), "additionalProperties": False}}}


TOOLS = [
    function("get_weather", "The weather in a city.",
             {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}}),
    function("add", "Add two integers.",
             {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
              "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}),
    function("search", "Search the web.",
             {"query": {"type": "string", "maxLength": 40},
              "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}),
    function("book_table", "Book a restaurant table.",
             {"restaurant": {"type": "string", "maxLength": 24},
              "people": {"type": "integer", "minimum": 1, "maximum": 12},
              "outdoor": {"type": "boolean"}}),
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "What is 17 plus 25?",
             "Find recent news about solar panels.", "Book a table for four at Luigi's.",
             "Is it raining in Oslo?", "Add 300 and -12.", "Search for pasta recipes.",
             "Reserve an outdoor table for two at Sakura."]


def run(client: openai.OpenAI, model: str, requests: list[dict], pid: int) -> tuple[dict, list]:
    started, cpu_started = time.perf_counter(), process_cpu_seconds(pid)
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda body: client.chat.completions.create(model=model,
                                                                           **body), requests))
    seconds, cpu_seconds = time.perf_counter() - started, process_cpu_seconds(pid) - cpu_started
    tokens = sum(answer.usage.completion_tokens for answer in answers)
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / seconds, 2),
            "server_cpu_seconds": round(cpu_seconds, 3),
            "output_tokens_per_cpu_s": round(tokens / cpu_seconds, 2)}, answers


def validated(answers: list) -> tuple[int, int]:
    """(calls, calls that parse and match their tool's schema)."""
    calls = valid = 0
    for answer in answers:
        for call in answer.choices[0].message.tool_calls or ():
            calls += 1
            try:
                jsonschema.validate(json.loads(call.function.arguments),
                                    SCHEMAS[call.function.name])
                valid += 1
            except (ValueError, KeyError, jsonschema.ValidationError):
                pass
    return calls, valid


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1,
                        help="round-robin; each run's best kept (a shared machine)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    args = parser.parse_args(argv)
    app_args = ["--no-ui", "--max-num-seqs", str(args.num_requests)]
    if args.model:
        app_args += ["--model", args.model]
    env_threads = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    app = start_app(app_args, env=env_threads)
    try:
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="x", max_retries=0,
                               timeout=1800)
        model = client.models.list().data[0].id
        conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                         for i in range(args.num_requests)]
        with_tools = [{"messages": m, "tools": TOOLS, "tool_choice": "required",
                       "temperature": 0, "max_tokens": args.max_tokens} for m in conversations]
        run(client, model, with_tools[:1], app.process.pid)  # builds llguidance's tokenizer
        best: dict[str, dict] = {}
        calls = valid = unparsed = 0
        for _ in range(args.repeats):
            tools_result, answers = run(client, model, with_tools, app.process.pid)
            calls, valid = validated(answers)
            unparsed = sum(not answer.choices[0].message.tool_calls for answer in answers)
            plain = [{"messages": m, "temperature": 0, "extra_body": {"ignore_eos": True},
                      "max_tokens": answer.usage.completion_tokens}
                     for m, answer in zip(conversations, answers, strict=True)]
            plain_result, _ = run(client, model, plain, app.process.pid)
            for name, outcome in (("tools", tools_result), ("no_tools", plain_result)):
                if name not in best or outcome["output_tokens_per_s"] > best[name][
                        "output_tokens_per_s"]:
                    best[name] = outcome
    finally:
        stop_app(app)
    print(json.dumps({
        "machine": {"cpu": cpu_name(), "python": platform.python_version()},
        "workload": {"num_requests": args.num_requests, "tools": len(TOOLS),
                     "tool_choice": "required", "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "model": model},
        "results": best,
        "calls": {"total": calls, "valid": valid, "answers_without_calls": unparsed},
        "ratios": {
            "tools_vs_no_tools": round(best["tools"]["output_tokens_per_s"]
                                       / best["no_tools"]["output_tokens_per_s"], 3),
            "tools_vs_no_tools_by_cpu_time": round(
                best["tools"]["output_tokens_per_cpu_s"]
                / best["no_tools"]["output_tokens_per_cpu_s"], 3)},
    }, indent=2))
    sys.exit(0 if calls and valid == calls and not unparsed else 1)


if __name__ == "__main__":
    main()
