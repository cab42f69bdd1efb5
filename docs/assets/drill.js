/* InfraLab · interview drill.
 *
 * On a page that holds <div data-il-drill></div> (docs/interview.md), a "Start the drill" button
 * deals every question on the page (each `details.question`, gathered from the lab pages by the
 * build) in a random order, one at a time, with its answer hidden until asked for.
 *
 * Keys while the drill runs: Space or Enter shows (and hides) the answer, N or → the next
 * question, P or ← the previous one, Esc leaves. Keys typed into a field (the search box) are left
 * alone; on a focused button Space and Enter press that button, as everywhere. The keys the drill
 * uses are not passed on, so Material's own N and P (next and previous page) do not fire.
 *
 * Plain JavaScript, no library. Material's instant navigation swaps pages without reloading this
 * script, so the drill is set up again on every page through Material's `document$`.
 */
(function () {
  "use strict";
  if (window.__infralabDrill) return; // loaded once per tab, whatever the navigation does
  window.__infralabDrill = true;

  var drill = null; // the drill of the page on screen, or null

  function text(node) {
    var copy = node.cloneNode(true);
    copy.querySelectorAll(".headerlink").forEach(function (a) { a.remove(); });
    return copy.textContent.replace(/\s+/g, " ").trim();
  }

  function shuffled(n) {
    var order = [];
    for (var i = 0; i < n; i++) order.push(i);
    for (var j = n - 1; j > 0; j--) { // Fisher-Yates
      var k = Math.floor(Math.random() * (j + 1));
      var t = order[j]; order[j] = order[k]; order[k] = t;
    }
    return order;
  }

  function el(tag, attrs, content) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (name) { node.setAttribute(name, attrs[name]); });
    if (content !== undefined) node.textContent = content;
    return node;
  }

  function button(label, role) {
    return el("button", {type: "button", class: "md-button", "data-il-drill-action": role}, label);
  }

  /* Every question of the page, in page order, with the lab heading above it. */
  function gather(article) {
    var items = [], lab = "";
    article.querySelectorAll("h2, details.question").forEach(function (node) {
      if (node.tagName === "H2") { lab = text(node); return; }
      var summary = node.querySelector("summary");
      if (!summary) return;
      items.push({details: node, question: text(summary), lab: lab});
    });
    return items;
  }

  function build(mount, items) {
    var start = button("Start the drill", "start");
    start.classList.add("md-button--primary");
    var intro = el("p", {class: "il-drill__start"});
    intro.append(start, " ", el("span", {class: "il-drill__count"}, items.length + " questions, in a random order"));

    var panel = el("section", {class: "il-drill__panel", "aria-label": "Interview drill", tabindex: "-1"});
    panel.hidden = true;
    var prompt = el("div", {class: "il-drill__prompt", "aria-live": "polite", "aria-atomic": "true"});
    var status = el("p", {class: "il-drill__status"});
    var question = el("p", {class: "il-drill__question", id: "il-drill-question"});
    prompt.append(status, question);
    var reveal = button("Show the answer", "reveal");
    reveal.setAttribute("aria-expanded", "false");
    reveal.setAttribute("aria-controls", "il-drill-answer");
    var prev = button("← Previous", "prev"), next = button("Next →", "next"), leave = button("Leave", "leave");
    var controls = el("div", {class: "il-drill__controls"});
    controls.append(reveal, prev, next, leave);
    var answer = el("div", {class: "il-drill__answer", id: "il-drill-answer", "aria-live": "polite",
                            "aria-labelledby": "il-drill-question", role: "region"});
    var keys = el("p", {class: "il-drill__keys"});
    keys.innerHTML = "<kbd>Space</kbd> or <kbd>Enter</kbd> answer · <kbd>N</kbd> or <kbd>→</kbd> next · " +
                     "<kbd>P</kbd> or <kbd>←</kbd> previous · <kbd>Esc</kbd> leave";
    panel.append(prompt, controls, answer, keys);
    mount.replaceChildren(intro, panel);

    var state = {items: items, order: [], at: 0, open: false, active: false,
                 start: start, intro: intro, panel: panel, status: status, question: question,
                 reveal: reveal, prev: prev, next: next, answer: answer};
    start.addEventListener("click", function () { begin(state); });
    reveal.addEventListener("click", function () { toggle(state); });
    prev.addEventListener("click", function () { move(state, -1); });
    next.addEventListener("click", function () { move(state, 1); });
    leave.addEventListener("click", function () { end(state); });
    return state;
  }

  function show(state) {
    var n = state.items.length, item = state.items[state.order[state.at]];
    state.panel.setAttribute("data-il-drill-index", String(state.order[state.at]));
    state.status.textContent = "Question " + (state.at + 1) + " of " + n + (item.lab ? " · " + item.lab : "");
    state.question.textContent = item.question;
    state.open = false;
    state.answer.replaceChildren();
    state.reveal.setAttribute("aria-expanded", "false");
    state.reveal.textContent = "Show the answer";
    var focused = document.activeElement;
    state.prev.disabled = state.at === 0;
    state.next.disabled = state.at === n - 1;
    if (focused && focused.disabled) state.panel.focus(); // a button that just went dead keeps no focus
  }

  function toggle(state) {
    state.open = !state.open;
    state.reveal.setAttribute("aria-expanded", String(state.open));
    state.reveal.textContent = state.open ? "Hide the answer" : "Show the answer";
    if (!state.open) { state.answer.replaceChildren(); return; }
    var details = state.items[state.order[state.at]].details, parts = [];
    Array.prototype.forEach.call(details.children, function (child) {
      if (child.tagName === "SUMMARY") return;
      var copy = child.cloneNode(true);
      copy.removeAttribute("id");
      copy.querySelectorAll("[id]").forEach(function (node) { node.removeAttribute("id"); });
      parts.push(copy);
    });
    state.answer.replaceChildren.apply(state.answer, parts); // filled only now: the live region reads it
  }

  function move(state, step) {
    var at = Math.min(Math.max(state.at + step, 0), state.items.length - 1);
    if (at === state.at) return;
    state.at = at;
    show(state);
  }

  function begin(state) {
    state.order = shuffled(state.items.length);
    state.at = 0;
    state.active = true;
    state.intro.hidden = true;
    state.panel.hidden = false;
    show(state);
    state.panel.focus();
    state.panel.scrollIntoView({block: "start"});
  }

  function end(state) {
    state.active = false;
    state.answer.replaceChildren();
    state.panel.hidden = true;
    state.intro.hidden = false;
    state.start.focus();
  }

  function typing(target) {
    return target && (target.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(target.tagName));
  }

  document.addEventListener("keydown", function (event) {
    if (!drill || !drill.active || event.altKey || event.ctrlKey || event.metaKey || typing(event.target)) return;
    var key = event.key, onControl = event.target.closest && event.target.closest("button, a, summary, [role=button]");
    if (key === "Escape") end(drill);
    else if (key === "n" || key === "N" || key === "ArrowRight") move(drill, 1);
    else if (key === "p" || key === "P" || key === "ArrowLeft") move(drill, -1);
    else if ((key === " " || key === "Enter") && !onControl) toggle(drill);
    else return;
    event.preventDefault();
    event.stopPropagation(); // Material listens on window: its N and P would change the page
  });

  function setUp() {
    drill = null;
    var mount = document.querySelector("[data-il-drill]");
    var article = document.querySelector("article") || document.body;
    if (!mount) return;
    var items = gather(article);
    if (items.length) drill = build(mount, items);
  }

  if (window.document$ && typeof window.document$.subscribe === "function") window.document$.subscribe(setUp);
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUp);
  else setUp();
})();
