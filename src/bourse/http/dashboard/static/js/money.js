// The money page: balances, spend over time by account or by key, open and
// reconciling holds; the admin key or a billing (or higher) operator settles or
// releases a reconciling hold (each action confirmed in a dialog; the server writes it
// to the audit log), and an operator manages accounts and keys as their role allows
// (./manage.js).

import { get, post, query } from "./api.js";
import { dollars, timeChart } from "./charts.js";
import { $, h, notice, replaceRows, short, stamp, td, usd } from "./dom.js";
import { confirmAction } from "./confirm.js";
import * as manage from "./manage.js";

const REFRESH_MS = 5000;

export function mount(ctx) {
  const operator = ctx.session.staff;
  const mayClose = ctx.session.actions.includes("hold.settle");
  const win = $("#spend-window");
  const by = $("#spend-by");
  if (!operator) by.value = "key";
  const state = { chart: null, labels: "" };
  let timer = null;
  let alive = true;
  const forms = manage.mount(() => accounts(forms));

  const refresh = async () => {
    try {
      await Promise.all([accounts(forms), holds(mayClose, refresh), spend(state, win.value, by.value)]);
      updateCsv(win.value);
    } catch (err) {
      notice(err.message);
    }
  };
  const loop = async () => {
    await refresh();
    if (alive) timer = setTimeout(loop, REFRESH_MS);
  };
  const onChange = () => {
    if (state.chart) state.chart.destroy();
    state.chart = null;
    state.labels = "";
    refresh();
  };
  win.addEventListener("change", onChange);
  by.addEventListener("change", onChange);
  loop();
  return () => {
    alive = false;
    clearTimeout(timer);
    forms.unmount();
    win.removeEventListener("change", onChange);
    by.removeEventListener("change", onChange);
    if (state.chart) state.chart.destroy();
  };
}

function updateCsv(windowValue) {
  const [span] = windowValue.split(":").map(Number);
  const since = Math.floor(Date.now() / 1000 - span);
  $("#money-csv").setAttribute("href", "/dashboard/api/usage.csv" + query({ since }));
}

async function accounts(forms) {
  const doc = await get("/dashboard/api/accounts");
  forms.update(doc);
  replaceRows(
    $("#accounts tbody"),
    doc.data.map((a) =>
      h("tr", { "data-account": a.id, "data-status": a.status },
        forms.cell(a.id),
        td(a.status, "status"),
        td(usd(a.balance_micros), "num balance"),
        td(usd(a.open_holds_micros), "num"),
        td(usd(a.reconciling_micros), "num reconciling"),
        td(usd(a.spent_micros), "num"),
        td(usd(a.credited_micros), "num"),
      ),
    ),
    "No accounts.",
  );
}

async function holds(mayClose, refresh) {
  const [rec, open] = await Promise.all([
    get("/dashboard/api/holds?state=reconciling"),
    get("/dashboard/api/holds?state=open"),
  ]);
  replaceRows(
    $("#holds-reconciling tbody"),
    rec.data.map((x) =>
      h("tr", { "data-hold": x.id },
        h("td", { class: "mono", title: x.id }, short(x.id)),
        td(x.account_id),
        h("td", { class: "mono", title: x.request_id }, short(x.request_id)),
        td(x.product || "—"),
        td(usd(x.amount_micros), "num"),
        td(x.note || "—"),
        h("td", {}, mayClose ? holdButtons(x, refresh) : h("span", { class: "muted" }, "a billing operator decides")),
      ),
    ),
    "No reconciling holds.",
  );
  replaceRows(
    $("#holds-open tbody"),
    open.data.map((x) =>
      h("tr", { "data-hold": x.id },
        h("td", { class: "mono", title: x.id }, short(x.id)),
        td(x.account_id),
        h("td", { class: "mono", title: x.request_id }, short(x.request_id)),
        td(x.product || "—"),
        td(usd(x.amount_micros), "num"),
        td(stamp(x.created_at)),
      ),
    ),
    "No open holds.",
  );
}

function holdButtons(hold, refresh) {
  const act = async (verb) => {
    const what = verb === "settle"
      ? `Settle hold ${hold.id} of account ${hold.account_id}: charge its usage estimate (at most ${usd(hold.amount_micros)}) and return the rest?`
      : `Release hold ${hold.id} of account ${hold.account_id}: return all ${usd(hold.amount_micros)} to its balance, charging nothing?`;
    if (!(await confirmAction(what, verb === "settle" ? "Settle" : "Release"))) return;
    try {
      const out = await post(`/dashboard/api/holds/${encodeURIComponent(hold.id)}/${verb}`);
      notice(`Hold ${out.id} ${out.state}: charged ${usd(out.charged_micros)}.`);
    } catch (err) {
      notice(`Could not ${verb} hold ${hold.id}: ${err.message}`);
    }
    await refresh();
  };
  return h("span", { class: "inline" },
    h("button", { type: "button", class: "secondary", "data-action": "settle", onclick: () => act("settle") }, "Settle"),
    h("button", { type: "button", class: "danger", "data-action": "release", onclick: () => act("release") }, "Release"),
  );
}

async function spend(state, windowValue, by) {
  const [span, bucket] = windowValue.split(":").map(Number);
  const since = Math.floor(Date.now() / 1000 - span);
  const doc = await get("/dashboard/api/spend" + query({ since, bucket_s: bucket }));
  const label = (p) => (by === "key" ? `${p.account} · ${p.key_id || "no key"}` : p.account);
  const labels = [...new Set(doc.data.map(label))].sort();
  const times = [];
  for (let t = Math.floor(since / bucket) * bucket; t <= Date.now() / 1000; t += bucket) times.push(t);
  const index = new Map(times.map((t, i) => [t, i]));
  const series = labels.map(() => times.map(() => 0));
  for (const p of doc.data) {
    const i = index.get(p.t);
    if (i !== undefined) series[labels.indexOf(label(p))][i] += p.cost_micros / 1e6;
  }
  const key = labels.join("\n");
  if (!state.chart || key !== state.labels) {
    if (state.chart) state.chart.destroy();
    const shown = labels.length ? labels : ["no spend"];
    state.chart = timeChart(
      $("#chart-spend"),
      shown.map((l) => ({ label: l, step: true, value: (u, v) => (v === null || v === undefined ? "—" : "$" + v.toFixed(6)) })),
      { scales: { y: { range: (u, min, max) => [0, Math.max(1e-6, max)] } }, axes: [{ values: (u, vals) => vals.map(dollars), size: 80 }] },
    );
    state.labels = key;
  }
  state.chart.set([times, ...(labels.length ? series : [times.map(() => 0)])]);
}
