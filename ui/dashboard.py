"""build_ui(engine, session_log): the one gr.Blocks of the dashboard, wiring handlers."""

import json
from functools import partial
from pathlib import Path

import gradio as gr

from kvscope.engine.config import BLOCK_SIZES, KV_CACHE_DTYPES, PREEMPTION_MODES
from kvscope.engine.entrypoints.view import EngineView
from kvscope.ui import (
    chat,
    compare,
    figures,
    knobs,
    loadgen,
    panels,
    scrubber,
    sessions,
    tiers,
)
from kvscope.ui.form_values import form_number
from kvscope.ui.live import LiveFeeds
from kvscope.ui.plotdata import panel

CSS_PATH = Path(__file__).resolve().parent / "dashboard.css"
POLLER_PATH = Path(__file__).resolve().parent / "live_poller.js"
REFRESH_ENDPOINT = "refresh_live"
# The share of one core the browser may spend drawing the live panels, all together
# (ui/live_poller.js).
DRAW_DUTY = 0.03


def build_ui(engine: EngineView, session_log=None) -> gr.Blocks:
    """The dashboard for a started engine (an EngineView); session_log (a storage.SessionLog or None)
    feeds the sessions tab and gets the chat turns and reconfigures."""
    feeds = LiveFeeds(engine)
    renderer = panels.PanelRenderer(feeds)
    load = loadgen.LoadGenerator(engine)
    with gr.Blocks(title="kvscope") as blocks:
        gr.Markdown("# kvscope — the paged KV cache, live")
        summary = gr.HTML(panels.text_html(""), elem_id="kv-summary", elem_classes="kv-summary")
        with gr.Tabs():
            with gr.Tab("Live", id="live") as live_tab:
                live = _live_tab(engine, session_log, load, feeds)
            with gr.Tab("Engine & load", id="engine") as engine_tab:
                load_timer = _engine_tab(blocks, engine, feeds, session_log, load)
            with gr.Tab("Sessions", id="sessions") as sessions_tab:
                _sessions_tab(blocks, session_log, engine, sessions_tab)
            with gr.Tab("Compare", id="compare", elem_id="kv-compare") as compare_tab:
                compare.compare_tab(engine, session_log, compare_tab)
            other_tabs = [live_tab, sessions_tab, compare_tab]
            if engine.num_replicas > 1:  # an engine.replicas.ReplicaSet
                from kvscope.ui.replicas import replicas_tab  # the router's names; Ray is loaded

                with gr.Tab("Replicas", id="replicas") as replicas:
                    replicas_tab(engine)
                other_tabs.append(replicas)
        # The load generator's progress polls only while its tab is shown: a Gradio event
        # every 2 s cost an open Live tab CPU (round trip, status trackers) for nothing.
        engine_tab.select(lambda: gr.Timer(active=True), None, load_timer,
                          show_progress="hidden", api_visibility="private")
        for other in other_tabs:
            other.select(lambda: gr.Timer(active=False), None, load_timer,
                         show_progress="hidden", api_visibility="private")
        # What the tab shows ({panel: render version}) and which panels are on screen: the
        # browser's poller sends both; an API caller that sends nothing gets every panel.
        shown = gr.JSON(None, visible="hidden")
        visible = gr.JSON(None, visible="hidden")
        outputs = [summary, *(live[name] for name in panels.PANELS[1:]), shown]
        inputs = [shown, visible, *live["view_controls"]]
        # A page opens with every panel drawn through Gradio (which also loads Plotly);
        # from then on ui/live_poller.js asks this same endpoint once a second.
        blocks.load(renderer.refresh, inputs, outputs, show_progress="hidden", queue=False,
                    api_name=REFRESH_ENDPOINT).then(
            None, [shown, *live["view_controls"]], None, js=live_poller_js(),
            show_progress="hidden")
        for control in live["view_controls"]:  # a new view shows at once, not at the tick
            control.change(None, live["view_controls"], None, show_progress="hidden",
                           js="(...views) => { window.kvscopeLive?.setViews(views); }")
    return blocks


def live_poller_js() -> str:
    """The page's refresh loop (ui/live_poller.js) with this dashboard's panels in it."""
    config = {"endpoint": f"gradio_api/run/{REFRESH_ENDPOINT}", "panels": panels.PANELS,
              "text": panels.TEXT_PANELS, "refresh_ms": int(panels.REFRESH_S * 1000),
              "busy_refresh_ms": int(panels.BUSY_REFRESH_S * 1000),
              "draw_duty": DRAW_DUTY, "max_interval_ms": int(panels.MAX_INTERVAL_S * 1000),
              "slack_ms": int(panels.TICK_SLACK_S * 1000),
              "elements": {"summary": "kv-summary", **panels.PANEL_ELEMENTS},
              "follow_from": ["kv-timeline", "kv-block-tables"], "follow_field": "kv-follow"}
    return (f"(shown, ...views) => ({POLLER_PATH.read_text()})"
            f"({json.dumps(config)}, shown, views)")


def _live_tab(engine: EngineView, session_log, load, feeds) -> dict:
    with gr.Row():
        with gr.Column(scale=2):
            chatbot = gr.Chatbot(label="Chat", elem_id="kv-chat", height=420)
            message = gr.Textbox(placeholder="Message the model…", show_label=False,
                                 submit_btn=True, elem_id="kv-message")
            status = gr.Markdown(elem_classes="kv-status", elem_id="kv-chat-status")
            with gr.Accordion("Sampling", open=False, elem_id="kv-chat-sampling"):
                defaults, source = chat.sampling_defaults(engine)
                gr.Markdown(source, elem_id="kv-sampling-source")
                temperature, top_p, max_tokens, repetition_penalty, min_p = (
                    gr.Number(min(defaults[name], high), label=label, step=step,
                              precision=0 if step == 1 else None, elem_id=f"kv-{name}")
                    for name, (label, _, high, step) in chat.SAMPLING_FIELDS.items())
                # chat_template_kwargs={"enable_thinking": ...}, as vLLM's API takes it.
                thinking = gr.Checkbox(True, label="thinking (the template's enable_thinking)",
                                       visible=chat.has_thinking_switch(engine),
                                       elem_id="kv-thinking")
            new_chat = gr.Button("New chat", size="sm")
            with gr.Accordion("Guided scenarios", open=True):
                scenario_buttons = [gr.Button(s.name, size="sm") for s in loadgen.SCENARIOS]
                scenario_note = gr.Markdown(elem_id="kv-scenario")
            events = gr.HTML(panels.text_html(""), elem_id="kv-events",
                             elem_classes="kv-events")
        with gr.Column(scale=3):
            # Each tab shows the replica it chose (the summary line names it): the pick
            # sits above the pool it picks.
            replica = gr.Dropdown(list(range(engine.num_replicas)), value=0,
                                  label="replica shown on this tab", elem_id="kv-replica",
                                  visible=engine.num_replicas > 1)
            heatmap = panel("Block pool", "kv-heatmap")
            with gr.Row():
                heatmap_view = gr.Radio(figures.HEATMAP_VIEWS, value="whole pool",
                                        label="heatmap shows", elem_id="kv-heatmap-view")
                # No `minimum`: Gradio would refuse the whole refresh (every panel) for
                # one field; check_view_fields refuses the value at its field instead.
                heatmap_start = gr.Number(0, precision=0, label="from block")
                heatmap_stop = gr.Number(0, precision=0,
                                         label="to block (exclusive; 0 = the end)")
            # A model with recurrent layers: its state slots beside the block pool.
            state_slots = gr.HTML(panels.text_html(""), elem_id="kv-state-slots",
                                  visible=bool(engine.memory_plan.bytes_per_state_slot))
            stats = gr.HTML(panels.text_html(""), elem_id="kv-stats")
            # The step scrubber (ui/scrubber.py): every panel shows the recorded frame in
            # the field; blank = live.
            with gr.Row(elem_id="kv-scrubber"):
                # Words, not ⏸: without an emoji font that glyph is an empty box.
                pause = gr.Button("Pause", size="sm", elem_id="kv-pause")
                back = gr.Button("◀ frame", size="sm", elem_id="kv-step-back")
                forward = gr.Button("frame ▶", size="sm", elem_id="kv-step-forward")
                resume = gr.Button("Live", size="sm", elem_id="kv-resume")
                # Text, not a number field: blank (live) is its default, which API
                # callers of refresh_live may leave out.
                frame = gr.Textbox("", label="frame shown (blank = live)", max_lines=1,
                                   elem_id="kv-frame")
            scrub_status = gr.Markdown(elem_id="kv-scrub-status")
            # Click a chat turn, a timeline or block-table row (ui/live_poller.js) or type
            # a request id: its blocks are outlined in the heatmap, its rows marked in the
            # block tables and the timeline, its path in the prefix tree, on every
            # refresh until cleared.
            follow = gr.Textbox("", label="follow request (click a chat turn, or a timeline "
                                "or block-table row)", max_lines=1, elem_id="kv-follow")
    for button, scenario in zip(scenario_buttons, loadgen.SCENARIOS, strict=True):
        button.click(partial(_start_scenario, load, scenario.name), None, scenario_note,
                     api_name=f"scenario_{loadgen.SCENARIOS.index(scenario)}")
    conversation = gr.State(chat.new_conversation)
    message.submit(partial(chat.chat_reply, engine, session_log),
                   [message, conversation, temperature, top_p, max_tokens,
                    repetition_penalty, min_p, thinking],
                   [chatbot, conversation, message, status], concurrency_limit=None,
                   trigger_mode="always_last", api_name="chat")
    # A click on a chat turn follows its request across the panels (the follow field).
    chatbot.select(chat.follow_turn, [chatbot, conversation], follow, show_progress="hidden",
                   api_visibility="private")
    new_chat.click(lambda: ([], chat.new_conversation(), ""), None,
                   [chatbot, conversation, status], api_visibility="private")
    # The chat box's trash icon: without this it cleared the display only, and the next
    # message continued the hidden history.
    chatbot.clear(lambda: (chat.new_conversation(), ""), None, [conversation, status],
                  api_visibility="private")
    # Block ids need the page's width to stay legible: the tables have a row of their own.
    block_tables = panel("Block tables", "kv-block-tables")
    with gr.Row():
        table_order = gr.Radio(figures.TABLE_ORDERS, value="most recent",
                               label="sequences, ordered by")
        table_page = gr.Number(1, precision=0, label="page")
        table_filter = gr.Textbox("", label="sequence id contains", max_lines=1)
    with gr.Row():
        prefix_tree = panel("Prefix-sharing tree", "kv-prefix-tree")
        comparison = panel("Paged against contiguous", "kv-comparison")
    timeline_plot = panel("Request timelines", "kv-timeline")
    series = panel("KV usage, queues, throughput", "kv-series")
    spec_plot = panel("Speculative decoding", "kv-spec-decode")
    # Mixtures of experts only: the experts' load and the expert weights each step read.
    experts_plot = panel("Experts", "kv-experts", visible=engine.expert_layout is not None)
    scrub = [frame, scrub_status]
    pause.click(partial(scrubber.pause, feeds), replica, scrub, api_name="pause")
    back.click(partial(scrubber.step, feeds, by=-1), [replica, frame], scrub,
               api_name="step_back")
    forward.click(partial(scrubber.step, feeds, by=1), [replica, frame], scrub,
                  api_name="step_forward")
    resume.click(scrubber.resume, None, scrub, api_name="resume")
    # Checked once a value is typed (Enter, or the field left), not at each keystroke: the
    # digits typed so far of a kept frame or of a range's end are often out of range.
    view_fields = [heatmap_start, heatmap_stop, table_page]
    gr.on([event for field in view_fields for event in (field.blur, field.submit)],
          partial(panels.check_view_fields, feeds), [*view_fields, replica], view_fields,
          show_progress="hidden", api_name="check_view_fields")
    gr.on([frame.blur, frame.submit], partial(panels.check_frame, feeds), [frame, replica],
          None, show_progress="hidden", api_name="check_frame")
    return {"heatmap": heatmap, "block_tables": block_tables, "prefix_tree": prefix_tree,
            "timeline": timeline_plot, "series": series, "stats": stats,
            "comparison": comparison, "events": events, "spec_decode": spec_plot,
            "experts": experts_plot, "state_slots": state_slots,
            "view_controls": [heatmap_view, heatmap_start, heatmap_stop, table_order,
                              table_page, table_filter, replica, follow, frame]}


def _engine_tab(blocks, engine: EngineView, feeds, session_log, load) -> gr.Timer:
    """The knobs and the load generator; returns the timer of the load's progress line."""
    (block_size, utilization, memory_gb, budget, prefix, chunked,
     preemption, kv_dtype, offload_dir, offload_gb) = knobs.current_knobs(engine)
    gr.Markdown("### Knobs\nApply rebuilds the KV cache (weights stay loaded); new requests "
                "wait and running ones finish first unless you abort them.")
    with gr.Row():
        block_size = gr.Dropdown(list(BLOCK_SIZES), value=block_size, label="block_size",
                                 elem_id="kv-block-size")
        # Number fields, not sliders: a slider refused a typed value out of its range
        # with a server traceback, then clamped it to its maximum, and the next Apply
        # rebuilt the pool there. Apply and the preview refuse, naming the limit: the
        # engine's for the utilization, this machine's RAM for the memory.
        utilization = gr.Number(value=utilization, step=0.01, label="gpu_memory_utilization",
                                elem_id="kv-utilization")
        memory_gb = gr.Number(value=memory_gb, step=0.01, label="device_memory_gb (CPU)",
                              elem_id="kv-device-memory")
        budget = gr.Number(value=budget, precision=0, label="max_num_batched_tokens",
                           elem_id="kv-budget")
    with gr.Row():
        prefix = gr.Checkbox(value=prefix, label="prefix caching")
        chunked = gr.Checkbox(value=chunked, label="chunked prefill")
        preemption = gr.Radio(list(PREEMPTION_MODES), value=preemption,
                              label="preemption mode")
        kv_dtype = gr.Dropdown(list(KV_CACHE_DTYPES), value=kv_dtype, label="kv_cache_dtype",
                               elem_id="kv-cache-dtype")
        abort_running = gr.Checkbox(value=False, label="abort running requests")
    with gr.Row():
        offload_dir = gr.Textbox(value=offload_dir, label="kv_offload_dir (empty: no disk tier)",
                                 placeholder="a folder for the disk tier", elem_id="kv-offload-dir")
        offload_gb = gr.Number(value=offload_gb, step=0.5, label="kv_offload_gb",
                               elem_id="kv-offload-gb")
    apply = gr.Button("Apply", variant="primary", elem_id="kv-apply")
    knob_status = gr.Markdown(knobs.pool_markdown(engine.memory_plan, engine.config),
                              elem_id="kv-knob-status")
    # Before Apply: what these knobs would build, and the live sequences' waste in it.
    what_if = gr.Markdown(elem_id="kv-what-if")

    def preview(block_size, utilization, memory_gb) -> str:
        feed = feeds.get(0)
        with feed.lock:
            lengths = [seq.num_tokens for seq in feed.refresh().snapshot.sequences
                       if seq.block_table]
        return knobs.what_if_markdown(engine, lengths, block_size, utilization, memory_gb)
    gr.on([blocks.load, block_size.change, utilization.change, memory_gb.change], preview,
          [block_size, utilization, memory_gb], what_if, show_progress="hidden",
          api_name="what_if")
    form = [block_size, utilization, memory_gb, budget, prefix, chunked, preemption, kv_dtype,
            offload_dir, offload_gb]
    # The pool and the disk tier side by side; the state holds the counters last shown, so
    # bytes moved are per refresh.
    tier_counters = gr.State()
    tier_view = gr.Markdown(elem_id="kv-tiers")
    show_tiers = partial(tiers.tiers_markdown, engine)
    apply.click(partial(knobs.apply_knobs, engine, feeds), [*form, abort_running],
                knob_status, api_name="apply_knobs").then(
        show_tiers, tier_counters, [tier_view, tier_counters], show_progress="hidden",
        api_visibility="private")
    blocks.load(show_tiers, tier_counters, [tier_view, tier_counters], show_progress="hidden",
                api_visibility="private")
    # A new or reloaded tab shows the live knobs, not those the app started with.
    blocks.load(partial(knobs.live_form, engine), None, [*form, knob_status],
                api_visibility="private")

    spec = loadgen.default_spec(engine)
    gr.Markdown("### Load generator\nDrive the pool into eviction and preemption and watch "
                f"the Live tab: the defaults ask for {loadgen.DEFAULT_POOL_FILL:g} x the "
                "pool's token slots.")
    with gr.Row():
        count = gr.Number(value=spec.num_requests, precision=0, label="requests")
        rate = gr.Number(value=spec.rate, label="requests / s")
        # A number field, not a slider: Gradio's own range check of a slider is a server
        # traceback; LoadSpec refuses a fraction outside [0, 1] naming it.
        shared = gr.Number(value=spec.shared_fraction, step=0.05,
                           label="shared system prompt fraction")
        n = gr.Number(value=spec.n, precision=0, label="n (samples)")
    with gr.Row():
        prompt_min = gr.Number(value=spec.prompt_len[0], precision=0,
                               label="prompt tokens min")
        prompt_max = gr.Number(value=spec.prompt_len[1], precision=0,
                               label="prompt tokens max")
        output_min = gr.Number(value=spec.output_len[0], precision=0,
                               label="output tokens min")
        output_max = gr.Number(value=spec.output_len[1], precision=0,
                               label="output tokens max")
    send = gr.Button("Send load")
    load_status = gr.Markdown(load.status())
    send.click(partial(_start_load, load), [count, rate, shared, prompt_min, prompt_max,
                                            output_min, output_max, n], load_status,
               api_name="start_load")
    # While this tab is shown: the load's progress, and the preview of the sequences that
    # are live now (at page load they may have been others, or none).
    timer = gr.Timer(2.0, active=False)
    timer.tick(load.status, None, load_status, show_progress="hidden", api_visibility="private")
    timer.tick(preview, [block_size, utilization, memory_gb], what_if, show_progress="hidden",
               api_visibility="private")
    timer.tick(show_tiers, tier_counters, [tier_view, tier_counters], show_progress="hidden",
               api_visibility="private")
    return timer


def _start_load(load, count, rate, shared, prompt_min, prompt_max, output_min, output_max,
                n) -> str:
    try:
        whole = partial(form_number, integer=True)
        spec = loadgen.LoadSpec(
            whole("requests", count), form_number("requests / s", rate),
            form_number("shared system prompt fraction", shared, low=0, high=1),
            (whole("prompt tokens min", prompt_min), whole("prompt tokens max", prompt_max)),
            (whole("output tokens min", output_min), whole("output tokens max", output_max)),
            whole("n (samples)", n))
        load.start(spec)
    except ValueError as error:
        load.refuse(str(error))
        gr.Warning(f"Load not sent: {error}")
    return load.status()


def _start_scenario(load, name: str) -> str:
    try:
        return load.start_scenario(name)
    except ValueError as error:
        gr.Warning(f"Scenario not sent: {error}")
        return f"**Scenario not sent:** {error}"


def _sessions_tab(blocks, session_log, engine: EngineView, tab: gr.Tab) -> None:
    refresh = gr.Button("Refresh", size="sm")
    table = gr.Dataframe(headers=sessions.SESSION_COLUMNS, interactive=False,
                         label="Sessions", elem_id="kv-sessions-table")
    with gr.Row():
        session = gr.Dropdown(choices=[], label="session", elem_id="kv-session",
                              allow_custom_value=True)
        fmt = gr.Radio([("csv (a .zip: one CSV file per table)", "csv"), ("json", "json"),
                        ("sqlite", "sqlite")], value="json", label="export format")
        export = gr.Button("Export", elem_id="kv-export")
    status = gr.Markdown(elem_id="kv-sessions-status")
    download = gr.File(label="Download", elem_id="kv-download", interactive=False)
    stats = gr.Markdown()
    past_timeline = panel("Request timelines", "kv-session-timeline")
    past_series = panel("KV usage, queues, throughput")
    config = gr.JSON(label="Engine config")
    # The session's pool, frame by frame (ui/scrubber.py): the same panels as the Live tab.
    gr.Markdown("### The pool, step by step")
    with gr.Row():
        back = gr.Button("◀ frame", size="sm", elem_id="kv-session-back")
        forward = gr.Button("frame ▶", size="sm", elem_id="kv-session-forward")
        frame = gr.Textbox("", label="frame (blank = the last)", max_lines=1,
                           elem_id="kv-session-frame")
    frame_status = gr.Markdown(elem_id="kv-session-frame-status")
    frame_summary = gr.Markdown(elem_id="kv-session-summary")
    frame_panels = [panel(label, f"kv-session-{name}")
                    for name, label in (("heatmap", "Block pool"),
                                        ("block-tables", "Block tables"),
                                        ("prefix-tree", "Prefix-sharing tree"))]
    frame_events = gr.Markdown(elem_id="kv-session-events")
    frames = scrubber.SessionFrames(session_log, lambda token_ids: engine.tokenizer.decode(
        list(token_ids), skip_special_tokens=False))
    frame_outputs = [frame, frame_status, frame_summary, *frame_panels, frame_events]
    for button, by in ((back, -1), (forward, 1)):
        button.click(partial(frames.show, by=by), [session, frame], frame_outputs,
                     api_name=f"session_frame_{'back' if by < 0 else 'forward'}")
    frame.submit(frames.show, [session, frame], frame_outputs, api_name="session_frame")
    listing = partial(sessions.list_sessions, session_log)
    refresh.click(listing, None, [table, session, status], api_name="list_sessions")
    blocks.load(listing, None, [table, session, status], api_visibility="private")
    show_session = partial(sessions.show_session, session_log)
    session_views = [past_timeline, past_series, stats, config]
    session.change(show_session, session, session_views, api_name="show_session").then(
        lambda session_id: frames.show(session_id, None), session, frame_outputs,
        api_visibility="private")
    # The sessions grow while the engine runs: shown again, the tab lists them and draws
    # the chosen one anew (its frame stays where the user left it).
    tab.select(listing, session, [table, session, status], show_progress="hidden",
               api_visibility="private").then(
        show_session, session, session_views, show_progress="hidden",
        api_visibility="private").then(
        frames.show, [session, frame], frame_outputs, show_progress="hidden",
        api_visibility="private")
    export.click(partial(sessions.export_session, session_log), [session, fmt],
                 [download, status], api_name="export_session")
