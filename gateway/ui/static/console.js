/* Strata console: the usage chart and the copy button. htmx does the forms. */
(function () {
  "use strict";

  function drawUsage() {
    var box = document.getElementById("usage-chart");
    var source = document.getElementById("usage-data");
    if (!box || !source || typeof uPlot === "undefined") return;
    var data = JSON.parse(source.textContent);
    var width = Math.max(320, box.clientWidth);
    var opts = {
      width: width,
      height: 280,
      scales: { x: { time: true }, req: {} },
      series: [
        {},
        { label: "Prompt tokens", stroke: "#4f46e5", fill: "rgba(79,70,229,0.08)", width: 2, scale: "tok" },
        { label: "Completion tokens", stroke: "#0891b2", width: 2, scale: "tok" },
        { label: "Requests", stroke: "#d97706", width: 2, dash: [4, 4], scale: "req" }
      ],
      axes: [
        {},
        { scale: "tok", label: "tokens", size: 60 },
        { scale: "req", label: "requests", side: 1, grid: { show: false } }
      ]
    };
    var chart = new uPlot(opts, [data.x, data.prompt_tokens, data.completion_tokens, data.requests], box);
    var points = data.requests.filter(function (n) { return n > 0; }).length;
    box.setAttribute("data-points", String(points));
    window.addEventListener("resize", function () {
      chart.setSize({ width: Math.max(320, box.clientWidth), height: 280 });
    });
  }

  function copyButtons(root) {
    root.querySelectorAll("[data-copy]").forEach(function (button) {
      button.addEventListener("click", function () {
        var target = document.querySelector(button.getAttribute("data-copy"));
        if (!target || !navigator.clipboard) return;
        navigator.clipboard.writeText(target.textContent.trim()).then(function () {
          button.textContent = "Copied";
        });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawUsage();
    copyButtons(document);
  });
  document.addEventListener("htmx:afterSwap", function (event) {
    copyButtons(event.target);
  });
})();
