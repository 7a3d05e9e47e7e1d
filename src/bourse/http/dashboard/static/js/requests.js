// The requests page: finished requests and the requests refused before the book
// (this process's, kept in memory by the gateway), with filters by key, product and
// outcome, older pages on demand, and one request's detail (its receipt and usage
// record, or the refusal).
//
// The table is sorted by the column whose header was pressed (Started, newest
// first, to begin with); a request arriving live is put in its place by that order.
// While the pointer is over the table (or the keyboard is in it) nothing is
// inserted: the new rows wait, counted in the "N new" button, and go in when the
// pointer leaves or the button is pressed, so the row under the pointer never moves.

import { feed, get, query } from "./api.js";
import { $, clock, h, headings, labelRow, ms, notice, price, replaceRows, short, stamp, td, usd } from "./dom.js";

const MAX_ROWS = 500;

// Each sortable column: how a row's value is read (null sorts last either way), and
// whether its first press sorts descending (numbers, times) or ascending (names).
const SORTS = {
  created: { value: (r) => r.created, desc: true },
  id: { value: (r) => r.id, desc: false },
  account: { value: (r) => r.account, desc: false },
  key: { value: (r) => r.key_id, desc: false },
  product: { value: (r) => r.product, desc: false },
  deployment: { value: (r) => r.deployment, desc: false },
  outcome: { value: (r) => r.outcome, desc: false },
  status: { value: (r) => r.status, desc: true },
  bid: { value: (r) => r.bid, desc: true },
  cleared: { value: (r) => r.cleared_price, desc: true },
  tokens: { value: (r) => (r.prompt_tokens ?? 0) + (r.completion_tokens ?? 0), desc: true },
  cost: { value: (r) => r.cost_micros, desc: true },
  ttft: { value: (r) => r.ttft_ms, desc: true },
  latency: { value: (r) => r.latency_ms, desc: true },
};

function compare(key, desc) {
  const read = SORTS[key].value;
  return (a, b) => {
    const x = read(a);
    const y = read(b);
    const nx = x === null || x === undefined;
    const ny = y === null || y === undefined;
    if (nx !== ny) return nx ? 1 : -1;
    let c = 0;
    if (!nx) c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    if (desc) c = -c;
    // ties: newest first, then by id, so the order never depends on arrival
    return c || b.created - a.created || (a.id < b.id ? 1 : a.id > b.id ? -1 : 0);
  };
}

export function mount(ctx) {
  const operator = ctx.session.staff;
  const form = $("#request-filters");
  const productSel = $("#filter-product");
  if (productSel.options.length === 1) {
    for (const p of ctx.session.products) productSel.append(h("option", { value: p }, p));
  }
  const table = $("#requests");
  const heads = headings(table);
  const state = {
    filters: {}, rows: [], refused: [], next: null, oldest: null, source: null,
    sort: "created", desc: true, paused: false, pending: new Map(),
  }; // prettier-ignore
  const tbody = $("#requests tbody");
  const wrap = table.closest(".scroll");
  const more = $("#requests-more");
  const live = $("#requests-live");
  const pendingBtn = $("#requests-pending");

  const row = (r, fresh) => {
    const tr = h("tr", { class: fresh ? "new" : null, "data-request": r.id, "data-outcome": r.outcome },
      td(clock(r.created)),
      h("td", {}, h("button", { type: "button", class: "link", title: r.id, onclick: () => detail(r) }, short(r.id))),
      td(r.account),
      h("td", { class: "mono", title: r.key_id || "" }, short(r.key_id)),
      td(r.product),
      td(r.deployment, "deployment"),
      h("td", { class: "outcome", title: r.error || "" }, r.error ? `${r.outcome} · ${r.error}` : r.outcome),
      td(r.status, "status"),
      td(price(r.bid), "num bid"),
      td(price(r.cleared_price), "num cleared"),
      td(`${r.prompt_tokens ?? "—"} / ${r.completion_tokens ?? "—"}`, "num"),
      td(usd(r.cost_micros), "num"),
      td(ms(r.ttft_ms), "num"),
      td(ms(r.latency_ms), "num"),
    ); // prettier-ignore
    labelRow(tr, heads);
    return tr;
  };

  const detail = async (r) => {
    try {
      const d = await get(`/dashboard/api/requests/${encodeURIComponent(r.id)}` + query({ account: operator ? r.account : null }));
      showDetail(d);
    } catch (err) {
      notice(err.message);
    }
  };

  // the refusals shown: those no older than the oldest request loaded (older ones
  // come with the older pages, in their place)
  const inRange = (r) => state.oldest === null || r.created >= state.oldest;

  const render = () => {
    state.rows.sort(compare(state.sort, state.desc));
    replaceRows(tbody, state.rows.map((r) => row(r, false)), "No requests match.");
    for (const th of table.querySelectorAll("thead th")) {
      const b = th.querySelector("button[data-sort]");
      if (b && b.dataset.sort === state.sort) th.setAttribute("aria-sort", state.desc ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    }
  };

  const place = (r) => {
    // a new row in its place by the order shown (the rows already there do not move)
    if (tbody.querySelector(`tr[data-request="${CSS.escape(r.id)}"]`)) return;
    const empty = tbody.querySelector("tr.empty");
    if (empty) empty.remove();
    const cmp = compare(state.sort, state.desc);
    let i = 0;
    while (i < state.rows.length && cmp(state.rows[i], r) <= 0) i++;
    state.rows.splice(i, 0, r);
    tbody.insertBefore(row(r, true), tbody.rows[i] || null);
    while (state.rows.length > MAX_ROWS) {
      state.rows.pop();
      tbody.deleteRow(-1);
    }
  };

  const showPending = () => {
    const n = state.pending.size;
    pendingBtn.hidden = n === 0;
    pendingBtn.textContent = `${n} new`;
  };

  const flush = () => {
    const waiting = [...state.pending.values()];
    state.pending.clear();
    for (const r of waiting) place(r);
    showPending();
  };

  const hold = (on) => {
    state.paused = on;
    if (!on) flush();
  };
  // the keyboard in the table holds it too (a click leaves no visible focus)
  const keyboardIn = () => wrap.querySelector(":focus-visible") !== null;
  const pointerIn = () => hold(true);
  const pointerOut = () => hold(keyboardIn());
  const focusIn = () => hold(state.paused || keyboardIn());
  const focusOut = (ev) => {
    if (!wrap.contains(ev.relatedTarget)) hold(wrap.matches(":hover"));
  };

  const arrived = (r) => {
    if (state.paused) {
      state.pending.set(r.id, r);
      showPending();
    } else {
      place(r);
    }
  };

  const load = async () => {
    const doc = await get("/dashboard/api/requests" + query({ ...state.filters, limit: 50 }));
    state.next = doc.next_after;
    state.oldest = state.next && doc.data.length ? doc.data[doc.data.length - 1].created : null;
    state.refused = doc.refused || [];
    state.pending.clear();
    showPending();
    state.rows = [...doc.data, ...state.refused.filter(inRange)];
    render();
    more.hidden = !state.next;
  };

  const listen = () => {
    if (state.source) state.source.close();
    state.source = feed(
      "/dashboard/api/requests/events" + query(state.filters),
      { request: arrived },
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
    const before = state.oldest;
    state.next = doc.next_after;
    state.oldest = state.next && doc.data.length ? doc.data[doc.data.length - 1].created : null;
    const refused = state.refused.filter((r) => inRange(r) && before !== null && r.created < before);
    state.rows.push(...doc.data, ...refused);
    render();
    more.hidden = !state.next;
  };

  const sortBy = (ev) => {
    const b = ev.target.closest("button[data-sort]");
    if (!b) return;
    const key = b.dataset.sort;
    state.desc = key === state.sort ? !state.desc : SORTS[key].desc;
    state.sort = key;
    render();
  };

  const close = () => {
    $("#request-detail").hidden = true;
  };
  const thead = table.querySelector("thead");
  const listeners = [
    [form, "submit", apply], [more, "click", older], [$("#detail-close"), "click", close],
    [thead, "click", sortBy], [pendingBtn, "click", flush], [wrap, "pointerenter", pointerIn],
    [wrap, "pointerleave", pointerOut], [wrap, "focusin", focusIn], [wrap, "focusout", focusOut],
  ]; // prettier-ignore
  for (const [el, name, fn] of listeners) el.addEventListener(name, fn);
  apply();
  return () => {
    if (state.source) state.source.close();
    for (const [el, name, fn] of listeners) el.removeEventListener(name, fn);
    pendingBtn.hidden = true;
    close();
  };
}

function showDetail(d) {
  const kv = $("#detail-kv");
  const pairs = [
    ["Request", d.id], ["Account", d.account], ["Key", d.key_id], ["Product", d.product],
    ["Deployment", d.deployment], ["Created", stamp(d.created)], ["Outcome", d.outcome], ["Status", d.status],
    ["Error", d.error], ["Tokens in / out", `${d.prompt_tokens ?? "—"} / ${d.completion_tokens ?? "—"}`],
    ["Cost", usd(d.cost_micros)], ["Bid", d.bid], ["Cleared price", d.cleared_price],
    ["Waited", ms(d.queued_ms)], ["Time to first token", ms(d.ttft_ms)], ["Latency", ms(d.latency_ms)],
  ]; // prettier-ignore
  kv.replaceChildren(...pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v === null || v === undefined ? "—" : String(v))]));
  $("#detail-receipt").textContent = JSON.stringify(d.receipt, null, 2);
  $("#detail-record").textContent = JSON.stringify(d.record, null, 2);
  const panel = $("#request-detail");
  panel.hidden = false;
  $("#detail-title").textContent = `Request ${d.id}`;
  $("#detail-title").focus();
}
