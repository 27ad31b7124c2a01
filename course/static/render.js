// Render math (KaTeX) and diagrams (mermaid, to SVG) once the page has loaded.
(function () {
  document.querySelectorAll(".math.inline, .math.block").forEach(function (el) {
    try {
      katex.render(el.textContent, el, { displayMode: el.classList.contains("block"), throwOnError: false });
    } catch (e) { console.warn("math", e); }
  });
  mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: "neutral" });
  mermaid.run({ querySelector: "pre.mermaid" }).then(function () {
    document.body.dataset.mermaid = "done";
  });
})();
