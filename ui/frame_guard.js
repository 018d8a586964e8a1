// Stops a requestAnimationFrame loop that Gradio leaks on every page (gradio 6.31).
//
// Gradio's loading screen is a StatusTracker whose status is "pending" until the app has
// loaded. A pending StatusTracker counts its elapsed time in a requestAnimationFrame
// loop that stops only when its status leaves "pending". The loading screen is removed
// in the same update that makes the status "complete", so it never sees the change: its
// loop runs at 60 frames a second for as long as the page is open. An idle tab then
// cost ~0.06 of a core (a renderer main frame and a GPU-process frame each time), on a
// machine whose other cores run the engine.
//
// This runs before Gradio's scripts (ui.page.FrameGuard puts it first in <head>), so the
// trackers get this requestAnimationFrame. A frame asked for by a status tracker is drawn
// only while some status tracker is on screen (a pending one shows its spinner and
// timer); otherwise the callback is dropped, which ends that loop. A tracker that is
// pending again later starts a loop of its own.
(() => {
  const request = window.requestAnimationFrame.bind(window);
  const statusTracker = /\/statustracker-[^/]*\.js/;
  const trackerShown = () =>
    document.querySelector('[data-testid="status-tracker"]:not(.hide)') !== null;
  window.requestAnimationFrame = function (callback) {
    // Only a frame the tracker module asks for itself: the stack's lines are "Error",
    // this function, then its caller (a frame asked for by anything the tracker merely
    // started, a Svelte transition say, passes untouched).
    const caller = new Error().stack.split("\n")[2] ?? "";
    return statusTracker.test(caller)
      ? request((time) => { if (trackerShown()) callback(time); })
      : request(callback);
  };
})();
