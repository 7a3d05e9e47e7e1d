// The requests page: a live tail of finished requests (newest first) with filters by
// key, product and outcome, older pages on demand, and one request's detail (its
// receipt and usage record).

import { feed, get, query } from "./api.js";
import { $, clock, h, ms, notice, replaceRows, short, stamp, td, usd } from "./dom.js";

const MAX_ROWS = 500;

export function mount(ctx) {
  const operator = ctx.session.staff;
  const form = $("#request-filters");
  const productSel = $("#filter-product");
  if (productSel.options.length === 1) {
    for (const p of ctx.session.products) productSel.append(h("option", { value: p }, p));
  }
  const state = { filters: {}, rows: [], next: null, source: null };
  const tbody = $("#requests tbody");
  const more = $("#requests-more");
  const live = $("#requests-live");

  const row = (r, fresh) =>
    h("tr", { class: fresh ? "new" : null, "data-request": r.id },
      td(clock(r.created)),
      h("td", {}, h("button", { type: "button", class: "link", title: r.id, onclick: () => detail(r) }, short(r.id))),
      td(r.account),
      h("td", { class: "mono", title: r.key_id || "" }, short(r.key_id)),
      td(r.product),
      td(r.outcome),
      td(r.status),
      td(`${r.prompt_tokens ?? "—"} / ${r.completion_tokens ?? "—"}`, "num"),
      td(usd(r.cost_micros), "num"),
      td(ms(r.ttft_ms), "num"),
      td(ms(r.latency_ms), "num"),
    );

  const detail = async (r) => {
    try {
      const d = await get(`/dashboard/api/requests/${encodeURIComponent(r.id)}` + query({ account: operator ? r.account : null }));
      showDetail(d);
    } catch (err) {
      notice(err.message);
    }
  };

  const load = async () => {
    const doc = await get("/dashboard/api/requests" + query({ ...state.filters, limit: 50 }));
    state.rows = doc.data;
    state.next = doc.next_after;
    replaceRows(tbody, state.rows.map((r) => row(r, false)), "No requests match.");
    more.hidden = !state.next;
  };

  const listen = () => {
    if (state.source) state.source.close();
    state.source = feed(
      "/dashboard/api/requests/events" + query(state.filters),
      {
        request: (r) => {
          if (tbody.querySelector(`tr[data-request="${CSS.escape(r.id)}"]`)) return;
          const empty = tbody.querySelector("tr.empty");
          if (empty) empty.remove();
          tbody.prepend(row(r, true));
          while (tbody.rows.length > MAX_ROWS) tbody.deleteRow(-1);
        },
      },
      (up) => {
        live.textContent = up ? "live" : "reconnecting…";
        live.classList.toggle("on", up);
      },
    );
  };

  const apply = async (ev) => {
    if (ev) ev.preventDefault();
    const data = new FormData(form);
    state.filters = { key: data.get("key").trim(), product: data.get("product"), outcome: data.get("outcome") };
    $("#requests-csv").setAttribute("href", "/dashboard/api/usage.csv" + query({ ...state.filters, since: 0 }));
    try {
      await load();
    } catch (err) {
      notice(err.message);
    }
    listen();
  };

  const older = async () => {
    const doc = await get("/dashboard/api/requests" + query({ ...state.filters, limit: 50, after: state.next }));
    for (const r of doc.data) tbody.append(row(r, false));
    state.next = doc.next_after;
    more.hidden = !state.next;
  };

  const close = () => {
    $("#request-detail").hidden = true;
  };
  form.addEventListener("submit", apply);
  more.addEventListener("click", older);
  $("#detail-close").addEventListener("click", close);
  apply();
  return () => {
    if (state.source) state.source.close();
    form.removeEventListener("submit", apply);
    more.removeEventListener("click", older);
    $("#detail-close").removeEventListener("click", close);
    close();
  };
}

function showDetail(d) {
  const kv = $("#detail-kv");
  const pairs = [
    ["Request", d.id], ["Account", d.account], ["Key", d.key_id], ["Product", d.product],
    ["Created", stamp(d.created)], ["Outcome", d.outcome], ["Status", d.status],
    ["Tokens in / out", `${d.prompt_tokens ?? "—"} / ${d.completion_tokens ?? "—"}`],
    ["Cost", usd(d.cost_micros)], ["Bid", d.bid], ["Cleared price", d.cleared_price],
    ["Waited", ms(d.queued_ms)], ["Time to first token", ms(d.ttft_ms)], ["Latency", ms(d.latency_ms)],
  ];
  kv.replaceChildren(...pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v === null || v === undefined ? "—" : String(v))]));
  $("#detail-receipt").textContent = JSON.stringify(d.receipt, null, 2);
  $("#detail-record").textContent = JSON.stringify(d.record, null, 2);
  const panel = $("#request-detail");
  panel.hidden = false;
  $("#detail-title").textContent = `Request ${d.id}`;
  $("#detail-title").focus();
}
