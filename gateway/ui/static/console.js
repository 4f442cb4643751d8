/* Strata console: the usage and spend charts and the copy button. htmx does the forms. */
(function () {
  "use strict";

  // a chart of `series` (uPlot series and their data) over time in #<name>-chart, from the
  // JSON in #<name>-data; data-points on the box counts the buckets with any value
  function draw(name, build) {
    var box = document.getElementById(name + "-chart");
    var source = document.getElementById(name + "-data");
    if (!box || !source || typeof uPlot === "undefined") return;
    var spec = build(JSON.parse(source.textContent));
    var opts = {
      width: Math.max(320, box.clientWidth),
      height: 280,
      scales: spec.scales,
      series: [{}].concat(spec.series.map(function (s) { return s.opts; })),
      axes: [{}].concat(spec.axes)
    };
    var columns = spec.series.map(function (s) { return s.data; });
    var chart = new uPlot(opts, [spec.x].concat(columns), box);
    var points = spec.x.filter(function (_, i) {
      return columns.some(function (c) { return c[i] > 0; });
    }).length;
    box.setAttribute("data-points", String(points));
    window.addEventListener("resize", function () {
      chart.setSize({ width: Math.max(320, box.clientWidth), height: 280 });
    });
  }

  function usageChart(data) {
    return {
      x: data.x,
      scales: { x: { time: true }, req: {} },
      series: [
        { opts: { label: "Prompt tokens", stroke: "#4f46e5", fill: "rgba(79,70,229,0.08)", width: 2, scale: "tok" }, data: data.prompt_tokens },
        { opts: { label: "Completion tokens", stroke: "#0891b2", width: 2, scale: "tok" }, data: data.completion_tokens },
        { opts: { label: "Requests", stroke: "#d97706", width: 2, dash: [4, 4], scale: "req" }, data: data.requests }
      ],
      axes: [
        { scale: "tok", label: "tokens", size: 60 },
        { scale: "req", label: "requests", side: 1, grid: { show: false } }
      ]
    };
  }

  var TIER_COLOURS = { device: "#0891b2", host: "#16a34a", disk: "#d97706", remote: "#9333ea" };

  function spendChart(data) {
    var usd = function (u, v) { return v == null ? "" : "$" + v.toFixed(v < 1 ? 4 : 2); };
    var series = [
      { opts: { label: "Requests (USD)", stroke: "#4f46e5", fill: "rgba(79,70,229,0.08)", width: 2, scale: "usd", value: usd }, data: data.requests }
    ];
    Object.keys(data.kv).forEach(function (tier) {
      series.push({
        opts: { label: "KV " + tier + " (USD)", stroke: TIER_COLOURS[tier] || "#64748b", width: 2, dash: [4, 4], scale: "usd", value: usd },
        data: data.kv[tier]
      });
    });
    return {
      x: data.x,
      scales: { x: { time: true }, usd: {} },
      series: series,
      axes: [{ scale: "usd", label: "USD", size: 70, values: function (u, vals) { return vals.map(function (v) { return usd(u, v); }); } }]
    };
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
    draw("usage", usageChart);
    draw("spend", spendChart);
    copyButtons(document);
  });
  document.addEventListener("htmx:afterSwap", function (event) {
    copyButtons(event.target);
  });
})();
