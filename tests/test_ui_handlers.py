"""The dashboard's handlers and figures on a live engine, without a browser: the knob
form's refusals, per-run load progress, the shared renderer, the one clock of the time
series, and the quiet access log."""

import dataclasses
import json
import logging
import re
import shutil
import sys
import threading
import time

import pytest
from conftest import wait_until

from kvscope.app import QuietPolling
from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_offload.block_file import SUFFIX
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui import knobs, loadgen, panels, scrubber, tiers, timeline
from kvscope.ui.live import LiveFeed, LiveFeeds


@pytest.fixture(scope="module")
def engine(tiny_chat_model_path):
    """A pool sized from a small memory budget (no override), so it can be too small."""
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        device_memory_gb=0.02, max_model_len=256, max_num_batched_tokens=64)).start()
    yield engine
    engine.shutdown()


def form(engine, **changes) -> list:
    values = dict(zip(knobs.KNOBS, knobs.current_knobs(engine)))
    return [*{**values, **changes}.values(), False]


def test_a_pool_refusal_names_only_the_forms_knobs_with_live_and_asked_values(engine):
    before = engine.memory_plan
    status = knobs.apply_knobs(engine, LiveFeed(engine),
                               *form(engine, gpu_memory_utilization=0.001))
    assert status.startswith("**Not applied**") and "max_model_len" not in status
    assert "raise gpu_memory_utilization or device_memory_gb" in status
    assert "lower max_num_batched_tokens" in status
    assert "gpu_memory_utilization 0.9 → 0.001" in status
    assert engine.memory_plan == before


def test_an_emptied_token_budget_is_derived_and_zero_is_refused(engine):
    feed = LiveFeed(engine)
    status = knobs.apply_knobs(engine, feed, *form(engine, max_num_batched_tokens=0))
    assert "max_num_batched_tokens=0 must be an integer >= 1" in status
    assert knobs.apply_knobs(engine, feed, *form(engine, max_num_batched_tokens=None)) \
        .startswith("Applied.")
    assert engine.config.max_num_batched_tokens == 2048  # the derived default
    knobs.apply_knobs(engine, feed, *form(engine, max_num_batched_tokens=64))


def test_load_progress_is_per_run(engine):
    generator = loadgen.LoadGenerator(engine)
    spec = loadgen.LoadSpec(3, 100.0, 0.5, (4, 8), (2, 3))
    for run in (1, 2):
        generator.start(spec, seed=run)
        wait_until(lambda: generator.runs[-1].ended is not None, timeout=60,
                   what=f"load run {run} to end")
        assert f"run {run} (done" in generator.status()
        assert "sent 3 of 3 · finished 3 · aborted 0 · refused or failed 0 · in flight 0" in \
            generator.status().splitlines()[0]


def test_load_longer_than_the_corpus_is_sent_and_longer_than_the_model_is_refused(engine):
    import random

    generator = loadgen.LoadGenerator(engine)
    longer = 2 * len(generator._corpus) + 7  # the sample text is shorter than this prompt
    for shared in (0.0, 1.0):
        spec = loadgen.LoadSpec(1, 1.0, shared, (longer, longer), (1, 1))
        assert len(generator.prompt(spec, random.Random(4))) == longer
    with pytest.raises(ValueError, match="= 1000 is more than the engine's max_model_len=256"):
        generator.start(loadgen.LoadSpec(3, 1.0, 0.5, (900, 900), (16, 100)))
    # The page's 2 s progress poll keeps the refusal on top instead of overwriting it.
    assert generator.status().startswith("**Load not sent:** prompt tokens max 900")
    generator.start(loadgen.LoadSpec(1, 100.0, 0.0, (4, 8), (2, 2)), seed=2)
    assert "Load not sent" not in generator.status()


def test_a_load_thread_that_stops_early_says_why_on_the_status_line(tiny_chat_model_path):
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=64, max_model_len=64)).start()
    generator = loadgen.LoadGenerator(engine)
    generator.start(loadgen.LoadSpec(50, 5.0, 0.0, (4, 8), (2, 2)), seed=3)
    wait_until(lambda: generator.runs[-1].sent >= 1, timeout=30, what="a first request")
    engine.shutdown()
    wait_until(lambda: generator.runs[-1].error is not None, timeout=30,
               what="the run to stop")
    assert "(done" in generator.status() and "stopped sending: EngineClosed" in \
        generator.status()


def test_a_slow_load_run_ends_with_its_engine(tiny_chat_model_path):
    """A run at 0.01 requests/s waits 100 s for its second send; its threads (the sender
    and its stream drains) end once the engine stops, not then (the dashboard fuzz left
    them behind)."""
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=4,
        num_gpu_blocks_override=64, max_model_len=64)).start()
    generator = loadgen.LoadGenerator(engine)
    generator.start(loadgen.LoadSpec(3, 0.01, 0.0, (4, 8), (2, 2)), seed=5)
    wait_until(lambda: generator.runs[-1].finished == 1, timeout=30, what="the first answer")
    engine.shutdown()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("kvscope-loadgen")],
               timeout=10, what="the load generator's threads to end")
    assert "stopped sending: EngineClosed" in generator.status()


def test_knobs_beyond_the_machine_are_refused_in_their_own_terms(engine):
    before = engine.memory_plan
    feed = LiveFeed(engine)
    status = knobs.apply_knobs(engine, feed, *form(engine, max_num_batched_tokens=10**12))
    assert "max_num_batched_tokens=1000000000000 is more than one step can hold" in status
    assert "device_memory_gb x gpu_memory_utilization" in status and "Errno" not in status
    too_much = knobs.host_memory_bytes() / 2**30 + 1
    status = knobs.apply_knobs(engine, feed, *form(engine, device_memory_gb=too_much))
    assert f"device_memory_gb={too_much:g} is more than this machine's RAM" in status
    assert status.startswith("**Not applied**") and engine.memory_plan == before


def test_tabs_share_one_render_and_panels_out_of_view_cost_only_the_summary(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    *first, shown = renderer.refresh(None)
    assert all(not _skipped(value) for value in first)  # a new tab gets every panel
    rendered_at = {name: r.at for name, r in renderer._rendered[0].items()}
    *second, _ = renderer.refresh(None)  # a second tab, same tick: the same renders
    assert {name: r.at for name, r in renderer._rendered[0].items()} == rendered_at
    assert [value for value in second] == first
    *again, _ = renderer.refresh(shown)  # the first tab again: nothing new to send
    assert all(_skipped(value) for value in again)

    list(engine.submit("hidden", _params(4)))
    # The stream ends before the engine thread publishes that step's records and pool
    # delta; it answers a snapshot on its next turn, after them.
    engine.snapshot()
    series = renderer._rendered[0]["series"]
    no_summary = {name: value for name, value in shown.items() if name != "summary"}
    *hidden, _ = renderer.refresh(no_summary, [])
    assert not _skipped(hidden[0]) and all(_skipped(value) for value in hidden[1:])
    assert renderer._rendered[0]["series"] is series  # new steps, but not built while hidden
    *visible, _ = renderer.refresh(shown)
    assert not _skipped(visible[panels.PANELS.index("series")])


def test_handlers_that_refresh_the_feed_never_change_the_pool_under_a_render(engine):
    """The scrubber's buttons and the what-if preview refresh the same feed the panels
    render from, each on its own Gradio worker thread, while the engine steps."""
    feeds = LiveFeeds(engine)
    renderer = panels.PanelRenderer(feeds)
    errors, done = [], threading.Event()

    def hammer(call):
        try:
            while not done.is_set():
                call()
        except Exception as error:  # noqa: BLE001 - the test reports what any thread raised
            errors.append(error)
            done.set()

    threads = [threading.Thread(target=hammer, args=(call,)) for call in (
        lambda: renderer.refresh(None),
        lambda: scrubber.pause(feeds, 0),
        lambda: feeds.get(0).refresh())]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave within a render, as under load
    for thread in threads:
        thread.start()
    try:
        for round_ in range(40):
            streams = [engine.submit(f"race {round_} {i} " * 3, _params(12)) for i in range(8)]
            for stream in streams:
                list(stream)
    finally:
        done.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switch_interval)
    assert errors == []


def test_a_refresh_sent_anything_but_the_pollers_shapes_sends_every_panel(engine):
    # Found by tests/fuzz: refresh_live is a public API route, and `visible=False` (or a
    # list for `shown`) raised TypeError in the handler.
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    for shown, visible in (([], False), ("x", 3), ({"summary": 1}, [1, None]), (None, {})):
        *values, _ = renderer.refresh(shown, visible)
        assert len(values) == len(panels.PANELS)
        assert not any(_skipped(value) for value in values[1:])


def test_a_refresh_sends_back_only_its_panels_versions(engine):
    """Found by tests/fuzz: `shown` comes back in the reply, and {'': -2**63 - 1} made the
    reply's JSON fail ('Integer exceeds 64-bit range'), so the handler raised."""
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    *_, shown = renderer.refresh({"": -2 ** 63 - 1, "summary": 2 ** 64, "heatmap": "3"})
    assert set(shown) <= set(panels.PANELS) and all(type(v) is int for v in shown.values())
    json.dumps(shown)
    *_, again = renderer.refresh({**shown, "not a panel": 1})
    assert again == shown


def test_a_rebuilt_panel_that_draws_the_same_is_not_sent_again(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    *_, shown = renderer.refresh(None)
    before = {name: (r.at, r.version) for name, r in renderer._rendered[0].items()}
    for rendered in renderer._rendered[0].values():  # as if the pool had moved on: all due
        rendered.signature = ("moved on", rendered.signature[1])
    *again, now_shown = renderer.refresh(shown)
    assert all(renderer._rendered[0][name].at > at for name, (at, _) in before.items())  # rebuilt
    assert {name: r.version for name, r in renderer._rendered[0].items()} == \
        {name: version for name, (_, version) in before.items()}
    assert all(_skipped(value) for value in again) and now_shown == shown

def test_a_busy_engine_rebuilds_its_panels_within_one_budget_for_all(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    renderer._cost.update(heatmap=0.01, stats=0.001)
    assert renderer.interval("heatmap") == panels.REFRESH_S  # cheap in all: every tick
    renderer._cost.update(heatmap=0.2, summary=0.5)
    # The cheap stats line keeps its tick and the heatmap takes the rest of one budget;
    # the summary line is exempt.
    assert renderer.interval("stats") == panels.REFRESH_S
    assert renderer.interval("heatmap") == pytest.approx(0.2 / (panels.PANEL_DUTY - 0.001))
    assert renderer.interval("summary") == panels.REFRESH_S
    renderer._cost["heatmap"] = 10.0
    assert renderer.interval("heatmap") == panels.MAX_INTERVAL_S


def test_panels_that_change_at_every_step_share_one_budget():
    costs = {"a": 0.001, "b": 0.02, "c": 0.02, "d": 0.02}
    intervals = panels.shared_intervals(costs, 0.03, 1.0, 8.0)
    assert intervals["a"] == 1.0  # its share covers it: every tick
    # The rest split what is left equally, each alone would have drawn every second.
    assert [intervals[name] for name in "bcd"] == pytest.approx([0.06 / 0.029] * 3)
    assert sum(cost / intervals[name] for name, cost in costs.items()) == \
        pytest.approx(0.03)
    assert panels.shared_intervals({"a": 1.0}, 0.03, 1.0, 8.0) == {"a": 8.0}


def _params(max_tokens: int):
    from kvscope.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def _skipped(value) -> bool:
    return isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1


# ---- the time series -------------------------------------------------------------------
def _record(step: int, start: float, generated: int = 1, preempted=(), used: int = 4,
            free: int = 4) -> StepRecord:
    return StepRecord(step, start, start + 0.1, (), tuple(preempted), (), (), (), 1, 8, used,
                      0, free, 1, 0, num_generated_tokens=generated)


def test_the_timeline_and_the_series_read_one_clock_in_a_window_that_follows_a_new_run():
    old = [_record(i, 1000.0 + i * 0.2) for i in range(10)]
    new = [_record(10 + i, 1300.0 + i * 0.2) for i in range(10)]
    now = 1303.0
    start, end = timeline.live_window(old + new, now)
    assert end == now and start == pytest.approx(1300.0 - timeline.RUN_MARGIN_S)
    series = timeline.pool_series(old + new, window=(start, end))
    assert series["layout"]["xaxis"]["type"] == "date"
    assert series["layout"]["xaxis"]["range"] == [start * 1000, end * 1000]
    # The first drawn step is the new run's: the old one is outside the window.
    assert series["data"][0]["x"][0] == pytest.approx(new[0].end_time * 1000)


def test_series_break_at_idle_gaps_step_and_put_preemptions_on_their_own_axis():
    records = [_record(0, 10.0), _record(1, 10.2, preempted=["a", "b"]),
               _record(2, 30.0, used=8, free=0)]
    figure = timeline.pool_series(records)
    usage = figure["data"][0]
    assert usage["line"]["shape"] == "hv" and usage["y"] == [50.0, 50.0, None, 100.0]
    preemptions = figure["data"][-1]
    assert preemptions["yaxis"] == "y4" and preemptions["y"] == [2]
    assert figure["layout"]["yaxis4"]["overlaying"] == "y3"


def test_usage_is_measured_against_each_steps_own_pool():
    small, large = _record(0, 10.0, used=8, free=0), _record(1, 10.1, used=8, free=56)
    assert timeline.pool_series([large, small])["data"][0]["y"] == [12.5, 100.0]


def test_a_full_history_draws_a_bounded_line_that_keeps_every_spike():
    records = [_record(i, 1000.0 + i * 0.01, used=8 if i == 1234 else 4,
                       free=0 if i == 1234 else 4) for i in range(3000)]
    usage = timeline.pool_series(records)["data"][0]
    assert len(usage["y"]) <= timeline.MAX_SERIES_POINTS + 1
    assert max(usage["y"]) == 100.0 and min(usage["y"]) == 50.0  # the one-step spike stays
    assert usage["x"] == sorted(usage["x"])
    assert usage["x"][-1] == pytest.approx(records[-1].end_time * 1000)  # up to the last step


def test_the_stats_rate_is_a_rolling_one():
    records = [_record(i, 100.0 + i, generated=5) for i in range(20)]
    assert timeline.recent_output_rate(records, now=120.0) == pytest.approx(
        5 * 10 / timeline.RATE_WINDOW_S)
    assert timeline.recent_output_rate(records, now=500.0) == 0


# ---- the log ---------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "status", "kept"), [
    ("/gradio_api/queue/data?session_hash=x", 200, False), ("/", 200, False),
    ("/gradio_api/queue/join", 500, True), ("/v1/completions", 200, True),
    ("/metrics", 200, True)])
def test_the_access_log_drops_dashboard_polling_only(path, status, kept):
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0,
                               '%s - "%s %s HTTP/%s" %d', ("1.2.3.4", "GET", path, "1.1",
                                                           status), None)
    assert QuietPolling().filter(record) is kept


def test_a_long_step_is_work_not_an_idle_gap():
    slow = [StepRecord(i, 10.0 + 5 * i, 15.0 + 5 * i, (), (), (), (), (), 1, 8, 4, 0, 4, 1,
                       0) for i in range(3)]  # 5 s steps back to back
    assert None not in timeline.pool_series(slow)["data"][0]["y"]


def test_the_hit_rate_names_its_unit_and_scope_and_why_metrics_differs():
    text = timeline.HitRates(48, 100, 90, 200).describe()
    assert "48% of 100 prompt tokens since the pool was built" in text
    assert "(45% of 200 since the engine started, as /metrics' prefix_cache_hits" in text
    assert "engine started" not in timeline.HitRates(1, 2, 1, 2).describe()  # they agree


def test_series_keep_their_colours_whatever_lines_are_drawn_and_usage_is_not_pinned():
    records = [_record(i, 10.0 + i * 0.2) for i in range(5)]
    live = timeline.pool_series(records, [(10.0, 0.02, 0.01), (10.5, 0.03, 0.02)])  # Live tab
    logged = timeline.pool_series(records)  # a logged session: no token-slot samples

    def colours(figure):
        return {trace["name"]: trace["line"]["color"] for trace in figure["data"]
                if "line" in trace}
    assert colours(logged).items() <= colours(live).items()
    usage_axis = live["layout"]["yaxis"]
    assert "range" not in usage_axis and usage_axis["rangemode"] == "tozero"


def test_the_default_load_asks_for_more_than_the_pool_holds(engine):
    spec = loadgen.default_spec(engine)
    spec.validate(engine.memory_plan.max_model_len)
    tokens = spec.num_requests * (sum(spec.prompt_len) + sum(spec.output_len)) / 2
    assert tokens >= engine.memory_plan.num_tokens


def test_the_event_log_says_what_happened_in_plain_words_newest_first():
    from kvscope.ui import events

    admitted = StepRecord(7, 1.0, 1.1, (("r1", "r1#0", "prefill", 0, 32),), (), (), (), (),
                          32, 64, 8, 0, 8, 1, 0)
    busy = StepRecord(8, 1.1, 1.2, (("r1", "r1#0", "prefill", 32, 64),), ("r2#0",), (), (),
                      ("r3",), 32, 64, 16, 0, 0, 1, 1, prefix_cache_queries=40,
                      prefix_cache_hits=16,
                      preemptions=(("r2#0", "priority", "r4#0", 3, 20),))
    lines = events.event_lines([admitted, busy], [events.Evictions(8, 12)])
    assert lines[0] == "step 8: evicted 12 cached blocks, least recently used first, to " \
        "make room"
    assert ("step 8: preempted r2#0 (a higher-priority request needed its blocks to start, "
            "for r4#0): 3 blocks freed, 20 computed tokens to compute again") in lines
    assert "step 8: r1#0 prefilled its next chunk, tokens 32–64 (chunked prefill)" in lines
    assert "step 8: the prefix cache supplied 16 of 40 prompt tokens" in " ".join(lines)
    assert any(line.startswith("step 8: r3 finished") for line in lines)
    assert lines[-1] == "step 7: admitted r1#0: prefilling tokens 0–32"
    assert len(events.event_lines([busy] * 40)) == events.MAX_EVENTS


def test_the_summary_says_when_the_tabs_replica_is_down():
    from kvscope.engine.orchestrator.async_engine import EngineCounters, ReplicaStatus

    statuses = [ReplicaStatus(0, True, None, 0, 2, 0.5, EngineCounters()),
                ReplicaStatus(1, False, "replica 1 died: actor killed", 1, 0, 0.0,
                              EngineCounters())]
    assert panels.replica_down(statuses, 0) == ""
    assert panels.replica_down(statuses, 1).startswith(
        "**replica 1 is down**: replica 1 died: actor killed (restarted 1 times)")


def test_a_first_chunk_after_a_prefix_hit_is_an_admission_not_chunked_prefill():
    from kvscope.ui import events

    hit = StepRecord(9, 1.0, 1.1, (("r4", "r4#0", "prefill", 16, 40),), (), (), (), (),
                     24, 64, 10, 0, 0, 1, 0, prefix_cache_queries=40, prefix_cache_hits=16)
    tail = StepRecord(10, 1.1, 1.2, (("r4", "r4#0", "prefill", 40, 64),), (), (), (), (),
                      24, 64, 16, 0, 0, 1, 0)
    lines = events.event_lines([hit, tail], [events.Evictions(9, 1)])
    assert "step 10: r4#0 prefilled its next chunk, tokens 40–64 (chunked prefill)" in lines
    assert "step 9: admitted r4#0: tokens 0–16 from the prefix cache, prefilling tokens " \
        "16–40" in lines
    assert "step 9: evicted 1 cached block, least recently used first, to make room" in lines


def test_the_what_if_preview_predicts_the_pool_apply_builds_and_the_waste(engine):
    memory_gb = engine.config.device_memory_gb
    preview = knobs.what_if_markdown(engine, [5, 9], 8, 0.9, memory_gb)
    predicted = knobs.planned_pool(engine, 8, 0.9, memory_gb).num_blocks
    assert f"the pool would hold {predicted} blocks x 8" in preview
    # 5 and 9 tokens: 1 + 2 blocks of 8, 10 slots empty; in blocks of 4: 2 + 3, 6 empty.
    assert "would hold 3 blocks; the empty slots of their last blocks (internal " \
        "fragmentation) are 10 tokens, 41.7%" in preview
    assert "hold now 5 blocks" in preview and "6 tokens, 30.0%" in preview
    feed = LiveFeed(engine)
    try:
        assert knobs.apply_knobs(engine, feed, *form(engine, block_size=8)) \
            .startswith("Applied.")
        assert engine.memory_plan.num_blocks == predicted
    finally:
        knobs.apply_knobs(engine, feed, *form(engine, block_size=4))
    assert "Apply would be refused" in knobs.what_if_markdown(engine, [], 4, 0.001, memory_gb)


@pytest.mark.parametrize(("block_size", "utilization", "refusal"), [
    (8, 1e300, "gpu_memory_utilization=1e+300 must be in (0, 1]"),
    (3, 0.9, "block_size=3 must be a power of two"),
])
def test_the_what_if_preview_refuses_what_apply_refuses_in_the_engines_words(
        engine, block_size, utilization, refusal):
    # A huge utilization once overflowed the pool arithmetic (the fuzzer sent 1e300).
    preview = knobs.what_if_markdown(engine, [5], block_size, utilization,
                                     engine.config.device_memory_gb)
    assert preview.startswith("**What if:** Apply would be refused:") and refusal in preview


def test_each_guided_scenario_sends_its_load_and_says_what_to_watch(engine):
    generator = loadgen.LoadGenerator(engine)
    # The pool run is the longest (twice the pool in requests): its size is checked, the
    # others are sent and run to the end.
    pushed = loadgen.SCENARIOS[1].spec(engine.memory_plan, engine.config)
    pushed.validate(engine.memory_plan.max_model_len)
    assert pushed.num_requests * sum(pushed.prompt_len) / 2 > engine.memory_plan.num_tokens
    for scenario in (loadgen.SCENARIOS[0], *loadgen.SCENARIOS[2:]):
        note = generator.start_scenario(scenario.name)
        assert note.startswith(f"**{scenario.name}** — ") and "watch" in note.lower()
        wait_until(lambda: generator.runs[-1].ended is not None, timeout=120,
                   what=f"the {scenario.name} scenario to end")
        run = generator.runs[-1]
        assert run.finished == run.spec.num_requests and run.error is None, scenario.name
    assert generator.runs[1].spec.n == 4
    with pytest.raises(ValueError, match="scenario='nope' must be one of"):
        generator.start_scenario("nope")


@pytest.mark.parametrize("value, refusal", [
    (None, "pages is empty: enter a whole number from 1 to 9"),
    ("  ", "pages is empty"),
    ("banana", "pages='banana' is not a number: enter a whole number from 1 to 9"),
    (2.5, "pages=2.5 is not a whole number"),
    (float("inf"), "pages=inf is not a whole number"),
    (99999999999, "pages=1e+11 is out of range: enter a whole number from 1 to 9"),
])
def test_a_form_value_is_refused_naming_its_field_and_limits(value, refusal):
    from kvscope.ui.form_values import form_number

    with pytest.raises(ValueError, match=re.escape(refusal)):
        form_number("pages", value, integer=True, low=1, high=9)
    assert form_number("pages", "7", integer=True, low=1, high=9) == 7


@pytest.mark.parametrize("budget", [64, 2048, 4096])
def test_the_long_prompt_scenario_chunks_at_the_live_token_budget(engine, budget):
    """Its prompt is sized from max_num_batched_tokens: a fixed 2,048 tokens equalled the
    default budget and prefilled in one step."""
    import dataclasses

    plan = dataclasses.replace(engine.memory_plan, max_model_len=32768)
    config = dataclasses.replace(engine.config, max_num_batched_tokens=budget)
    spec = loadgen.SCENARIOS[3].spec(plan, config)
    assert spec.prompt_len[0] == spec.prompt_len[1] > 2 * budget  # three prefill steps
    spec.validate(plan.max_model_len)


def test_the_long_prompt_scenario_says_which_knob_keeps_it_from_chunking(engine):
    import dataclasses

    plan = dataclasses.replace(engine.memory_plan, max_model_len=256)
    config = dataclasses.replace(engine.config, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_num_batched_tokens=256, but max_model_len=256 "
                       "leaves room for 248 prompt tokens: set max_num_batched_tokens below "
                       "248"):
        loadgen.SCENARIOS[3].spec(plan, config)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        loadgen.SCENARIOS[3].spec(plan, dataclasses.replace(
            config, enable_chunked_prefill=False, max_num_batched_tokens=None))


def test_the_load_generator_counts_aborted_requests_as_metrics_does(engine):
    """An Apply with "abort running requests" ends the run's running requests: they are
    counted aborted, as /metrics' finished_reason="abort" counts them, not finished."""
    generator = loadgen.LoadGenerator(engine)
    aborts_before = engine.counters().requests_finished.get("abort", 0)
    generator.start(loadgen.LoadSpec(64, 100.0, 0.0, (8, 16), (200, 200)), seed=7)
    wait_until(lambda: engine.snapshot().num_running >= 1, timeout=30,
               what="a load request to run")
    assert knobs.apply_knobs(engine, LiveFeed(engine), *form(engine)[:-1], True) \
        .startswith("Applied.")
    wait_until(lambda: generator.runs[-1].ended is not None, timeout=120,
               what="the run to end")
    run = generator.runs[-1]
    aborted = engine.counters().requests_finished.get("abort", 0) - aborts_before
    assert run.aborted == aborted >= 1
    assert run.finished + run.aborted == run.sent == 64 and run.failed == 0
    assert f"finished {run.finished} · aborted {run.aborted} · refused or failed 0" in \
        generator.status()


def test_a_click_on_a_chat_turn_follows_that_turns_request(engine):
    """The chat keeps each reply's request (the streaming one's from its start); a click
    on a user message or on its reply (either part of a folded reasoning reply) gives it."""
    from kvscope.ui import chat

    conversation, shown = chat.new_conversation(), []
    for message in ("first", "second"):
        replies = chat.chat_reply(engine, None, message, conversation, 0.0, 1.0, 4)
        shown, conversation, *_ = next(replies)
        shown, streaming, *_ = next(replies)  # taken: the reply's request is known now
        assert chat.turn_request(shown, streaming, len(shown) - 1) == \
            streaming["requests"][-1] != ""
        for shown, conversation, *_ in replies:
            pass
    first, second = conversation["requests"]
    assert first != second
    assert [chat.turn_request(shown, conversation, i) for i in range(4)] == [
        first, first, second, second]
    folded = [shown[0], {"role": "assistant", "content": "hmm",
                         "metadata": {"title": "Reasoning"}}, *shown[1:]]
    assert [chat.turn_request(folded, conversation, i) for i in range(5)] == [
        first, first, first, second, second]


def test_a_session_without_pool_frames_says_why_in_every_scrubber_panel(engine, tmp_path):
    """A session that has run nothing yet is told apart from one logged without pool
    records, and each panel says so (none keeps the session shown before, none is blank)."""
    import json

    from kvscope.storage import SessionLog
    from kvscope.ui.scrubber import SessionFrames

    log = SessionLog(tmp_path / "log.db")
    try:
        session_id = log.start_session(engine.config.to_dict(), engine.model_path)
        frame, status, summary, *plots, events = SessionFrames(log, str).show(session_id, "")
        assert "run no engine step yet" in status and (frame, summary, events) == ("", "", "")
        for plot, title in zip(plots, ("Block pool", "Block tables", "Prefix-sharing tree"),
                               strict=True):
            layout = json.loads(plot.plot)["layout"]
            assert layout["title"]["text"] == title
            assert "run no engine step yet" in layout["annotations"][0]["text"]
        _, status, _, *plots, _ = SessionFrames(log, str).show(session_id + 1, "")
        assert "no such session" in status and all(
            json.loads(plot.plot)["layout"]["annotations"] for plot in plots)
    finally:
        log.close()


def test_the_occupancy_gauge_samples_blocks_and_token_slots_together(engine):
    """Each refresh reads both fractions off one snapshot of the pool, so the token slots
    filled are never more than the blocks in use hold, while usage rises and falls."""
    feed = LiveFeed(engine)
    streams = [engine.submit([5 + i] * (20 + 7 * i), SamplingParams(max_tokens=12, ignore_eos=True))
               for i in range(4)]
    readers = [threading.Thread(target=list, args=(stream,)) for stream in streams]
    for reader in readers:
        reader.start()
    while any(reader.is_alive() for reader in readers):
        feed.refresh()
        time.sleep(0.005)
    wait_until(lambda: feed.refresh().usage_samples[-1][1] == 0, timeout=10,
               what="the pool to empty")  # usage fell to nothing
    samples = feed.refresh().usage_samples
    assert len(samples) > 2 and max(b for _, b, _ in samples) > 0
    assert all(tokens <= blocks for _, blocks, tokens in samples)


def test_preemptions_are_marked_by_reason_on_the_series_and_the_timelines():
    causes = (("a", "priority", "c", 2, 9), ("b", "kv_full", "b", 1, 4))
    start = _record(0, 10.0)
    chunks = (("ra", "a", "prefill", 0, 9), ("rb", "b", "prefill", 0, 4))
    ran = dataclasses.replace(start, chunks=chunks)
    preempted = dataclasses.replace(_record(1, 10.2, preempted=["a", "b"]), preemptions=causes)
    back = dataclasses.replace(_record(2, 10.4), chunks=chunks)
    figure = timeline.pool_series([ran, preempted, back])
    marks = {trace["name"]: trace["y"] for trace in figure["data"]
             if trace["name"].startswith("preemptions")}
    assert marks == {"preemptions: kv_full": [1], "preemptions: priority": [1]}
    spans = [s for s in timeline.timeline_spans([ran, preempted, back])
             if s.phase == "preempted"]
    assert [s.label for s in spans] == [
        "preempted (a higher-priority request needed its blocks to start, for c): 2 blocks "
        "freed, 9 computed tokens to compute again",
        "preempted (the pool was out of blocks for a running sequence's next tokens, for "
        "itself: it gave way alone): 1 block freed, 4 computed tokens to compute again"]


def test_the_why_panel_tells_a_followed_requests_waits_preemptions_and_prefix_hits():
    from kvscope.ui import why

    first = dataclasses.replace(_record(0, 10.0), chunks=(("r1", "r1", "prefill", 16, 24),))
    cause = ("r1", "priority", "r9", 2, 24)
    preempted = dataclasses.replace(_record(1, 10.2, preempted=["r1"]), preemptions=(cause,))
    again = dataclasses.replace(_record(2, 10.4), chunks=(("r1", "r1", "prefill", 0, 24),),
                                finished=("r1",))
    text = why.why_markdown([first, preempted, again], {"r1": 9.5}, "r1")
    assert text.splitlines()[2:] == [
        "- step 0: r1 started after waiting 0.500 s in the queue; the prefix cache supplied "
        "tokens 0–16, not recomputed",
        "- step 1: r1 preempted (a higher-priority request needed its blocks to start, for "
        "r9): 2 blocks freed, 24 computed tokens to compute again",
        "- step 2: r1 (re)started", "- step 2: r1 finished"]
    taker = why.why_lines([preempted], {}, "r9")
    assert taker == ["step 1: r9 took the blocks of r1 (a higher-priority request needed its "
                     "blocks to start, for r9): 2 blocks freed, 24 computed tokens to compute "
                     "again"]
    assert "no step of it" in why.why_markdown([first], {}, "r7")


def test_prefix_misses_say_why_in_the_why_panel_and_the_event_log():
    from kvscope.ui import events, why

    evicted = ("r2", "evicted", 8, "r9", 3)
    partial = ("r2#1", "partial_block", 2, None, None)
    salted = ("r4", "salt_mismatch", 16, None, None)
    record = dataclasses.replace(_record(5, 11.0), prefix_misses=(evicted, partial, salted))
    evicted_words = ("step 5: r2 missed 8 tokens the prefix cache once held: r9's blocks "
                     "evicted them in step 3")
    partial_words = ("step 5: r2#1 shares 2 tokens past its prefix hit with a cached block, "
                     "and they cannot hit: the shared text ends mid-block, and only full "
                     "blocks are cached")
    salted_words = ("step 5: r4 missed 16 tokens the prefix cache holds under another "
                    "cache_salt: requests share a prefix only under one salt")
    assert why.why_lines([record], {}, "r2") == [evicted_words, partial_words]
    assert why.why_lines([record], {}, "r9") == [evicted_words]  # the evictor's story too
    assert why.why_lines([record], {}, "r4") == [salted_words]
    assert why.why_lines([record], {}, "r3") == []
    # Newest first.
    assert events.event_lines([record]) == [salted_words, partial_words, evicted_words]


def test_following_a_request_puts_its_why_above_the_event_log(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    renderer.refresh(None)  # the feed subscribes to the steps before the request runs
    list(engine.submit([7] * 30, SamplingParams(max_tokens=3), request_id="why-me"))
    follow = [None] * 7 + ["why-me"]  # panel_views' order: ..., replica, follow

    def events_panel() -> str:
        *values, _ = renderer.refresh(None, ["events"], *follow)
        return str(values[panels.PANELS.index("events")])
    wait_until(lambda: "finished" in events_panel(), timeout=10, what="the request's steps")
    log = events_panel()
    assert "Why: why-me" in log and "started after waiting" in log and "<strong>Events<" in log


def test_the_disk_tier_is_turned_on_sized_and_shown_next_to_the_pool(engine, tmp_path):
    feed = LiveFeed(engine)
    view, _ = tiers.tiers_markdown(engine)
    assert view.startswith("**Disk tier:** off") and "--kv-offload-dir" in view
    status = knobs.apply_knobs(engine, feed, *form(engine, kv_offload_dir=str(tmp_path),
                                                   kv_offload_gb=0.05))
    assert status.startswith("Applied."), status
    assert engine.config.kv_offload_dir == str(tmp_path) and engine.config.kv_offload_gb == 0.05
    prompt = [11 + i % 50 for i in range(40)]
    list(engine.submit(prompt, SamplingParams(max_tokens=2)))
    # Apply again: the old pool's cached blocks go to the tier, and the new pool is empty,
    # so the same prompt's prefix comes back from the disk.
    assert knobs.apply_knobs(engine, feed, *form(engine)).startswith("Applied.")
    view, before = tiers.tiers_markdown(engine)
    list(engine.submit(prompt, SamplingParams(max_tokens=2)))
    view, _ = tiers.tiers_markdown(engine, before)
    counters = engine.counters()
    assert counters.kv_tier_blocks > 0 and counters.kv_offload_loads > 0
    rows = {row.split("|")[1].strip(): row.split("|")[2:4] for row in view.splitlines()
            if row.startswith("| ")}
    files = list(tmp_path.glob(f"*/*{SUFFIX}"))
    assert rows["blocks held"][1].strip() == str(len(files))
    held = tiers.size(sum(file.stat().st_size for file in files))
    assert rows["bytes held (of size)"][1].strip() == f"{held} of {0.05 * 1024:.1f} MiB"
    assert rows["hit rate"][1].strip().startswith(
        f"{counters.external_prefix_cache_hits / counters.external_prefix_cache_queries:.1%}")
    moved_in = rows["bytes moved since last refresh"][1].split()
    assert float(moved_in[0]) > 0 and moved_in[1] in ("KiB", "MiB")
    assert "mean over" in rows["load latency"][1]
    # Emptying the directory turns it off again.
    assert knobs.apply_knobs(engine, feed, *form(engine, kv_offload_dir="")).startswith(
        "Applied.")
    assert engine.config.kv_offload_dir is None
    assert tiers.tiers_markdown(engine)[0].startswith("**Disk tier:** off")


def test_a_disk_tier_the_machine_cannot_hold_is_refused_and_never_applied(engine, tmp_path):
    before = engine.config
    feed = LiveFeed(engine)
    free = shutil.disk_usage(tmp_path).free / 2**30
    cases = [({"kv_offload_gb": free + 1}, f"kv_offload_gb={free + 1:g} is larger than the "
                                           "free disk"),
             ({"kv_offload_gb": 0}, "kv_offload_gb=0.0 must be > 0"),
             ({"kv_offload_gb": None}, "kv_offload_gb is empty"),
             ({"kv_offload_dir": str(tmp_path / "file" / "tier")}, "is not an existing directory"),
             ({"kv_offload_dir": str(tmp_path / "not-made-yet")}, "create the folder first"),
             ({"kv_offload_dir": "tier"}, "given by its absolute path")]
    (tmp_path / "file").write_text("not a folder")
    for changes, message in cases:
        status = knobs.apply_knobs(engine, feed, *form(
            engine, **{"kv_offload_dir": str(tmp_path), "kv_offload_gb": 1.0, **changes}))
        assert status.startswith("**Not applied**") and message in status, status
        assert engine.config == before
