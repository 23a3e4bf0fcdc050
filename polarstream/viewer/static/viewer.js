// polarstream ui: live updates. Every 2 s ask the index's change counter (/seq); when it moved, fetch
// this page again and swap in its <main>. Plain polling: no build step, nothing from a CDN.
(function () {
  "use strict";
  const badge = document.getElementById("live-state");

  function show(text, cls) {
    if (badge) { badge.textContent = text; badge.className = cls; }
  }

  async function tick() {
    const live = document.getElementById("live");
    if (!live) return;
    try {
      const run = live.dataset.run;
      const answer = await fetch("/seq" + (run ? "?run=" + run : ""), { credentials: "same-origin" });
      const { seq } = await answer.json();
      if (String(seq) !== live.dataset.seq) {
        const html = await (await fetch(location.href, { credentials: "same-origin" })).text();
        const fresh = new DOMParser().parseFromString(html, "text/html").getElementById("live");
        // Swap only what changed: a hovered token keeps its tooltip when another run moved the counter.
        if (fresh && fresh.innerHTML !== live.innerHTML) live.replaceWith(fresh);
        else live.dataset.seq = String(seq);
      }
      show("● live", "ok");
    } catch (e) {
      show("○ not reachable", "off");
    }
  }

  setInterval(tick, 2000);
  tick();
})();
