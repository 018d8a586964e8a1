"""assets/grafana works against a live kvscope as shipped: every PromQL selector in the
dashboard matches a series of /metrics, with the labels its aggregations group by."""

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import serve
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.serving import create_app

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "grafana"
# A metric name with a namespace (vllm:..., kvscope:...) and its optional label matchers.
SELECTOR = re.compile(r"(?P<name>[a-zA-Z_][\w]*:[\w:]+)\s*(?:\{(?P<matchers>[^}]*)\})?")
# A label matcher: PromQL's =, !=, =~ and !~ (regexes match the whole value).
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
MATCHES = {"=": lambda value, wanted: value == wanted,
           "!=": lambda value, wanted: value != wanted,
           "=~": lambda value, wanted: re.fullmatch(wanted, value) is not None,
           "!~": lambda value, wanted: re.fullmatch(wanted, value) is None}
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((ASSETS / "kvscope.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.fixture(scope="module")
def live_metrics(tiny_chat_model_path) -> tuple[str, list]:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=8,
        num_gpu_blocks_override=64, max_model_len=256)).start()
    url, server, thread = serve(create_app(engine))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=model, prompt="fill the histograms", max_tokens=3,
                                  extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics").text
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()
    samples = [sample for family in text_string_to_metric_families(text)
               for sample in family.samples]
    return model, samples


def test_every_dashboard_selector_matches_a_live_series(live_metrics):
    model, samples = live_metrics
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    for expression in expressions:
        expression = expression.replace("$model_name", model)
        selectors = list(SELECTOR.finditer(expression))
        assert selectors, expression
        grouped_by = {label.strip() for group in GROUPING.findall(expression)
                      for label in group.split(",")} - {"le"}
        for selector in selectors:
            matchers = selector["matchers"] or ""
            wanted = MATCHER.findall(matchers)
            # Every matcher is read: one this pattern misses would go unchecked.
            assert MATCHER.sub("", matchers).strip(", ") == "", (matchers, expression)
            matching = [s for s in samples if s.name == selector["name"]
                        and all(MATCHES[op](s.labels.get(label, ""), value)
                                for label, op, value in wanted)]
            assert matching, f"no series for {selector['name']}{{{matchers}}} in: {expression}"
            for label in grouped_by:
                assert all(label in s.labels for s in matching), (label, expression)


# Every series vLLM's own dashboard (examples/observability/prometheus_grafana/grafana.json)
# queries, by panel: with kvscope's /metrics none of its panels stays empty.
VLLM_DASHBOARD_SERIES = {
    "E2E Request Latency": ["vllm:e2e_request_latency_seconds_bucket",
                            "vllm:e2e_request_latency_seconds_sum"],
    "Token Throughput": ["vllm:prompt_tokens_total", "vllm:generation_tokens_total"],
    "Inter Token Latency": ["vllm:inter_token_latency_seconds_bucket"],
    "Scheduler State": ["vllm:num_requests_running", "vllm:num_requests_waiting"],
    "Time To First Token Latency": ["vllm:time_to_first_token_seconds_bucket"],
    "Cache Utilization": ["vllm:kv_cache_usage_perc"],
    "Request Prompt Length": ["vllm:request_prompt_tokens_bucket"],
    "Request Generation Length": ["vllm:request_generation_tokens_bucket"],
    "Finish Reason": ["vllm:request_success_total"],
    "Queue Time": ["vllm:request_queue_time_seconds_sum"],
    "Requests Prefill and Decode Time": ["vllm:request_prefill_time_seconds_sum",
                                         "vllm:request_decode_time_seconds_sum"],
    "Max Generation Token in Sequence Group": ["vllm:request_max_num_generation_tokens_sum"],
}


def test_vllms_own_dashboard_finds_its_series(live_metrics):
    model, samples = live_metrics
    served = {s.name for s in samples if s.labels.get("model_name") == model
              and s.labels.get("engine") == "0"}
    for panel, series in VLLM_DASHBOARD_SERIES.items():
        assert set(series) <= served, panel


def test_the_model_variable_and_the_scrape_config(live_metrics):
    model, samples = live_metrics
    dashboard = json.loads((ASSETS / "kvscope.json").read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    source = SELECTOR.search(variable["definition"])["name"]
    assert {s.labels["model_name"] for s in samples if s.name == source} == {model}
    scrape = yaml.safe_load((ASSETS / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["localhost:7860"]  # app.py's --port
