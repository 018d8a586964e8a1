// The live panels' refresh in the browser (started once per page by ui.dashboard).
//
// Why not a gr.Timer: each Gradio event round trip costs the browser ~0.1 of a core even
// when every output is skipped (queue join and stream, state and status-tracker updates
// for each output), and gr.Plot redraws a new value twice (Plotly.react, then
// Plots.resize). On a machine that also runs the engine that came out of the engine's
// tok/s. This loop makes one plain POST to the same Gradio endpoint (refresh_live,
// unqueued) per tick, and puts only the changed panels in place: Plotly.react on the
// plot's own div, the text panels' HTML into their wrapper.
function startLivePoller(config, shown, views) {
  const live = (window.kvscopeLive ??= {});
  live.shown = shown || {};
  live.views = views;
  if (live.started) return;
  live.started = true;
  const root = (window.gradio_config?.root || location.href.split(/[?#]/)[0]).replace(/\/?$/, "/");
  const url = new URL(config.endpoint, root);
  let timer = null, inFlight = false, again = false;
  // While figures change (the engine is busy) the page asks every busy_refresh_ms, not
  // every refresh_ms: each tick then redraws figures, the browser's main cost; an idle
  // engine is still noticed within refresh_ms.
  let drewFigure = false;
  // Gradio builds a whole session state (a copy of every component's config) for a call
  // that names no session, on the server's event loop, holding the engine's GIL: ~4 % of
  // a core at one call a second on this page. One session per page is built once.
  const sessionHash = `kv-live-${Math.random().toString(36).slice(2)}`;
  // What drawing each panel costs this browser (ms, smoothed) and when it was last drawn.
  // All panels share one drawing budget of draw_duty of a core, max-min fairly, as the
  // server shares PANEL_DUTY (ui/panels.py shared_intervals): cheapest first, a panel
  // whose equal share of what is left covers it is drawn every refresh_ms, the costly
  // ones split the rest (capped at max_interval_ms). During decode most figures change
  // at every step; on a machine that also runs the engine, a budget per figure would
  // cost the engine that budget times the figure count.
  const drawCost = {}, drawnAt = {};
  const intervals = () => {
    const names = Object.keys(drawCost).filter((name) => name !== "summary")
      .sort((a, b) => drawCost[a] - drawCost[b]);
    const result = {};
    let left = config.draw_duty;
    names.forEach((name, index) => {
      const share = left / (names.length - index);
      const interval = share > 0 ? Math.max(config.refresh_ms, drawCost[name] / share)
        : config.max_interval_ms;
      result[name] = Math.min(interval, config.max_interval_ms);
      if (share > 0) left -= drawCost[name] / interval;
    });
    return result;
  };
  const due = (name, now, every) => !(name in drawnAt)
    || now - drawnAt[name] >= (every[name] ?? config.refresh_ms) - config.slack_ms;

  const onScreen = (id) => {
    const box = document.getElementById(id)?.getBoundingClientRect();
    return !!box && box.width > 0 && box.height > 0 && box.bottom > 0
      && box.top < window.innerHeight;
  };
  // A panel scrolled out of view, under another tab or on a hidden page is neither built
  // by the server nor redrawn here; it is drawn once it is on screen again.
  const visiblePanels = (now) => {
    if (document.hidden) return [];
    const every = intervals();
    return Object.entries(config.elements)
      .filter(([name, id]) => name !== "summary" && onScreen(id) && due(name, now, every))
      .map(([name]) => name);
  };

  const drawPlot = (id, value) => {
    const div = document.querySelector(`#${id} [data-testid="plotly"]`);
    if (!div || !window.Plotly) return false;  // not mounted yet: asked again next tick
    const figure = JSON.parse(value.plot);
    // As gr.Plot lays a figure out (its label sits over the plot's top margin).
    const layout = figure.layout;
    layout.autosize = true;
    layout.margin ??= {};
    if (layout.title) layout.margin.t = Math.max(100, layout.margin.t || 0);
    layout.margin.autoexpand = true;
    window.Plotly.react(div, figure.data, layout, {...figure.config, responsive: true});
    return true;
  };
  // Follow one request: a click on a timeline or block-table row puts its request id in
  // the "follow request" field, whose change sends the new view (setViews) at once.
  const requestOf = (label) => String(label).replace(/^▶ /, "").replace(/ \(.*\)$/, "")
    .split("#")[0];
  const followClicks = () => {
    for (const id of config.follow_from) {
      const div = document.querySelector(`#${id} [data-testid="plotly"]`);
      if (!div || !div.on || div.kvFollow) continue;
      div.kvFollow = true;
      div.on("plotly_click", (event) => {
        const point = event?.points?.[0];
        const field = document.querySelector(`#${config.follow_field} textarea, `
                                             + `#${config.follow_field} input`);
        if (!point || !field) return;
        field.value = requestOf(point.y);
        field.dispatchEvent(new Event("input", {bubbles: true}));
        field.dispatchEvent(new Event("change", {bubbles: true}));
      });
    }
  };
  const drawText = (id, html) => {
    const wrapper = document.querySelector(`#${id} .kv-html`);
    if (!wrapper) return false;
    wrapper.outerHTML = html;
    return true;
  };

  const poll = async () => {
    if (inFlight) { again = true; return; }
    clearTimeout(timer);
    inFlight = true;
    try {
      const response = await fetch(url, {
        method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({data: [live.shown, visiblePanels(performance.now()),
                                     ...live.views], session_hash: sessionHash}),
      });
      if (response.ok) {
        const {data} = await response.json();
        const next = data[config.panels.length] || {};
        drewFigure = false;
        config.panels.forEach((name, index) => {
          const value = data[index];
          if (value == null || value.__type__ === "update") return;  // gr.skip(): unchanged
          const id = config.elements[name];
          const started = performance.now();
          const drawn = config.text.includes(name) ? drawText(id, value) : drawPlot(id, value);
          if (drawn) {
            drewFigure ||= !config.text.includes(name);
            const cost = performance.now() - started;
            drawCost[name] = name in drawCost ? drawCost[name] + 0.3 * (cost - drawCost[name])
              : cost;
            drawnAt[name] = started;
          } else {
            if (name in live.shown) next[name] = live.shown[name]; else delete next[name];
          }
        });
        live.shown = next;
        followClicks();
      }
    } catch (error) {
      // The server restarting, or the network: the next tick tries again.
    } finally {
      inFlight = false;
      timer = setTimeout(poll, again ? 0 : drewFigure ? config.busy_refresh_ms
        : config.refresh_ms);
      again = false;
    }
  };
  // A new heatmap range, table page or scrubber frame is drawn at once, not at the next
  // tick (a frame changes every panel).
  live.setViews = (values) => {
    live.views = values;
    for (const name of Object.keys(drawnAt)) delete drawnAt[name];
    poll();
  };
  timer = setTimeout(poll, config.refresh_ms);
}
