// The market page: one product's book as a ladder with the level marked, depth and
// level over time, cleared prices, slot use per deployment, breaker states and the
// latest admissions, live from /dashboard/api/markets/{product}/events; for an operator
// who may change it, the product's configuration (market_config.js). A failed attempt
// (an admission whose run failed before any output, marked `failed` by the server,
// perhaps a sample after it first came) is no clear: it is listed apart and left out
// of the cleared prices. The price-against-wait curve is the forecast's: the wait a new
// order would be predicted at each bid (`wait_curve`), with how well the predictions
// came true lately (`forecast`).

import { feed } from "./api.js";
import { priceAxis, priceValue, timeChart } from "./charts.js";
import { $, clock, h, price, replaceRows, secs, td } from "./dom.js";
import * as config from "./market_config.js";

const KEEP = 1200;

export function mount(ctx) {
  const select = $("#market-product");
  const products = ctx.session.products;
  if (!select.options.length) {
    for (const p of products) select.append(h("option", { value: p }, p));
  }
  const wanted = ctx.arg && products.includes(ctx.arg) ? ctx.arg : select.value || products[0];
  select.value = wanted;
  const onChange = () => {
    location.hash = "market/" + encodeURIComponent(select.value);
  };
  select.addEventListener("change", onChange);

  const state = { points: [], clears: [], deployments: [], charts: null, product: wanted };
  const live = $("#market-live");
  const source = feed(
    `/dashboard/api/markets/${encodeURIComponent(wanted)}/events`,
    {
      history: (doc) => {
        state.points = doc.points;
        state.clears = doc.clears.slice().reverse();
        redraw(state);
      },
      snapshot: (doc) => {
        state.points.push(doc.point);
        if (state.points.length > KEEP) state.points.splice(0, state.points.length - KEEP);
        mergeClears(state, doc.clears);
        render(doc, state);
        redraw(state);
      },
    },
    (up) => {
      live.textContent = up ? "live" : "reconnecting…";
      live.classList.toggle("on", up);
    },
  );
  const unconfig = config.mount(ctx, wanted);
  return () => {
    unconfig();
    source.close();
    select.removeEventListener("change", onChange);
    if (state.charts) for (const c of Object.values(state.charts)) c.destroy();
  };
}

function mergeClears(state, newestFirst) {
  const cs = state.clears;
  const last = cs.length ? cs[cs.length - 1].t : -Infinity;
  for (const c of newestFirst.slice().reverse()) {
    if (c.t > last) cs.push(c);
    else if (c.failed) markFailed(cs, c);
  }
  if (cs.length > KEEP) cs.splice(0, cs.length - KEEP);
}

function markFailed(cs, c) {
  // an admission shown before, found failed since (the newest are at the end)
  for (let i = cs.length - 1; i >= 0 && cs[i].t >= c.t; i--) {
    if (cs[i].t === c.t && cs[i].deployment === c.deployment) cs[i].failed = true;
  }
}

const clearedOnly = (cs) => cs.filter((c) => !c.failed);

function render(doc, state) {
  $("#market-desc").textContent = `${doc.product}: floor ${price(doc.floor)}, default bid ${price(doc.default_bid)} (USD per 1M tokens)`;
  $("#stat-level").textContent = price(doc.level);
  $("#stat-best").textContent = price(doc.best_bid);
  $("#stat-waiting").textContent = String(doc.waiting);
  $("#stat-slots").textContent = `${doc.slots.busy} / ${doc.slots.total}`;
  $("#stat-floor").textContent = price(doc.floor);
  $("#stat-admitted").textContent = String(doc.admitted_total);
  renderLadder(doc);
  renderCurve(doc, state);
  replaceRows(
    $("#deployments tbody"),
    doc.deployments.map((d) =>
      h("tr", { "data-deployment": d.name },
        td(d.name),
        td(price(d.floor)),
        h("td", {}, h("progress", { max: d.slots, value: d.busy, "aria-label": `${d.busy} of ${d.slots} slots busy` }), ` ${d.busy} / ${d.slots}`),
        h("td", {}, d.available === false
          ? h("span", { class: "state unhealthy", title: d.reason || "" }, "unavailable")
          : h("span", { class: "state " + (d.healthy ? "healthy" : "unhealthy") }, d.healthy ? "healthy" : "cooling down")),
        td(d.available === false ? d.reason || "" : d.flavor || ""),
        h("td", {}, h("span", { class: "state " + d.breaker, "data-breaker": d.breaker }, d.breaker.replace("_", " "))),
      ),
    ),
  );
  const names = doc.deployments.map((d) => d.name).join("\n");
  if (names !== state.deployments.join("\n")) {
    state.deployments = doc.deployments.map((d) => d.name);
    if (state.charts) {
      state.charts.slots.destroy();
      state.charts.slots = slotsChart(state.deployments);
    }
  }
  const clearRow = (c) =>
    h("tr", { "data-deployment": c.deployment }, td(clock(c.t)), td(price(c.bid), "num"), td(price(c.price), "num"), td(secs(c.wait_s), "num"), td(c.deployment));
  replaceRows($("#admissions tbody"), clearedOnly(state.clears).slice(-20).reverse().map(clearRow), "No admissions yet.");
  replaceRows(
    $("#failed-attempts tbody"),
    state.clears.filter((c) => c.failed).slice(-20).reverse().map(clearRow),
    "No failed attempts.",
  );
}

function renderLadder(doc) {
  const tbody = $("#ladder tbody");
  const most = Math.max(1, ...doc.book.map((b) => b.orders));
  const rows = [];
  let marked = false;
  const levelRow = () =>
    h("tr", { class: "level", id: "ladder-level" },
      h("td", { colspan: 3 }, `level ${price(doc.level)}`),
    );
  for (const b of doc.book) {
    if (!marked && b.price < doc.level) {
      rows.push(levelRow());
      marked = true;
    }
    const bar = h("div", { class: "bar" });
    bar.style.width = `${(100 * b.orders) / most}%`;
    rows.push(
      h("tr", { class: "rung", "data-price": b.price, "data-orders": b.orders },
        td(price(b.price), "num"),
        td(String(b.orders), "num"),
        h("td", { class: "depth", "aria-hidden": "true" }, bar),
      ),
    );
  }
  if (!marked) rows.push(levelRow());
  if (!doc.book.length) rows.unshift(h("tr", { class: "empty" }, h("td", { colspan: 3 }, "No orders waiting.")));
  tbody.replaceChildren(...rows);
}

// The cheapest bid for each predicted wait as the page shows it (the curve is lowest
// price first; a higher price never waits longer; waits that read the same, such as
// 0.512 and 0.508 s, are one), by wait: what the chart draws and the table lists.
function curvePoints(curve) {
  const best = new Map();
  for (const c of curve || []) {
    if (c.wait_s === null || c.wait_s === undefined) continue;
    const shown = secs(c.wait_s);
    if (!best.has(shown)) best.set(shown, [c.wait_s, c.price]);
  }
  return [...best.values()].sort((a, b) => a[0] - b[0]);
}

function renderCurve(doc, state) {
  const pts = curvePoints(doc.wait_curve);
  state.curve = pts;
  const rows = pts.map(([w, p]) => h("tr", { "data-price": p }, td(price(p), "num"), td(secs(w), "num")));
  const none = (doc.wait_curve || []).filter((c) => c.wait_s === null).map((c) => c.price);
  if (none.length) {
    rows.push(h("tr", { class: "empty" }, h("td", { colspan: 2 }, `At ${price(Math.max(...none))} or less: no start predicted.`)));
  }
  replaceRows($("#wait-curve tbody"), rows, "Nothing predicted yet: no run seen.");
  const f = doc.forecast || {};
  $("#forecast-score").textContent = f.orders
    ? `Lately ${Math.round(100 * f.within_2x)} % of ${f.orders} orders started within 2x of the wait predicted (median error ${secs(f.median_abs_error_s)}).`
    : "No order has been scored yet.";
}

function slotsChart(deployments) {
  return timeChart(
    $("#chart-slots"),
    deployments.map((d) => ({ label: d, step: true })),
    { scales: { y: { range: (u, min, max) => [0, Math.max(1, max)] } } },
  );
}

function ensureCharts(state) {
  if (state.charts) return state.charts;
  state.charts = {
    depth: timeChart(
      $("#chart-depth"),
      [
        { label: "orders waiting", scale: "n", step: true },
        { label: "level", scale: "price", step: true, value: priceValue },
      ],
      { scales: { n: { range: (u, min, max) => [0, Math.max(1, max)] } }, axes: [{ scale: "n" }, priceAxis] },
    ),
    cleared: timeChart(
      $("#chart-cleared"),
      [
        { label: "cleared", scale: "price", points: true, value: priceValue },
        { label: "bid", scale: "price", points: true, hollow: true, value: priceValue },
      ],
      { axes: [priceAxis] },
    ),
    slots: slotsChart(state.deployments),
    curve: timeChart(
      $("#chart-curve"),
      [{ label: "bid", scale: "price", value: priceValue }],
      {
        scales: { x: { time: false } },
        axes: [priceAxis],
        x: {
          series: { label: "expected wait", value: (u, v) => secs(v) },
          axis: { values: (u, vals) => vals.map((v) => secs(v)) },
        },
      },
    ),
  };
  return state.charts;
}

function redraw(state) {
  if (!state.deployments.length && state.points.length) {
    state.deployments = Object.keys(state.points[state.points.length - 1].busy);
  }
  const charts = ensureCharts(state);
  const ts = state.points.map((p) => p.t);
  charts.depth.set([ts, state.points.map((p) => p.waiting), state.points.map((p) => p.level)]);
  charts.slots.set([ts, ...state.deployments.map((d) => state.points.map((p) => p.busy[d] ?? null))]);
  const cs = clearedOnly(state.clears);
  charts.cleared.set([cs.map((c) => c.t), cs.map((c) => c.price), cs.map((c) => c.bid)]);
  const pts = state.curve || [];
  charts.curve.set([pts.map(([w]) => w), pts.map(([, p]) => p)]);
}
