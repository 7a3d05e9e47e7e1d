// An operator's management of accounts and keys, on the money page: create an account;
// credit, debit or refund it (a debit or a refund with a reason); suspend, resume or
// close it; list its keys, create one (its secret shown once), edit, rotate or revoke
// one. Each form calls the dashboard's action route (the admin API's use case, audited
// by the server) and shows the route's error in the form. A form shows only when the
// session may take its action (the accounts list's `allowed`).
//
// A secret (a new or rotated key, the account's webhook secret) lives in the page only
// as the text of the secret box, until "I have copied it" empties it; no variable here
// keeps it.

import { get, patch, post, query } from "./api.js";
import { confirmAction } from "./confirm.js";
import { run, showError } from "./forms.js";
import { $, h, notice, replaceRows, short, stamp, td, usd } from "./dom.js";

const API = "/dashboard/api";
const enc = encodeURIComponent;

export function mount(refreshTable) {
  const ctl = new AbortController();
  const st = { allowed: new Set(), account: null, key: null, keys: [] };
  const on = (sel, ev, fn) => $(sel).addEventListener(ev, fn, { signal: ctl.signal });
  const refresh = async () => {
    await Promise.all([refreshTable(), st.account ? loadAccount(st) : null]);
  };

  on("#account-new", "submit", (ev) => run(ev, async (form) => {
    const id = value(form, "id");
    const credit = value(form, "credit_usd");
    const out = await post(`${API}/accounts`, credit === "" ? { id } : { id, credit_usd: Number(credit) });
    form.reset();
    notice(`Account ${out.id} created with a balance of ${usd(out.balance_micros)}.`);
    await refreshTable();
    await open(st, out.id);
  }));
  on("#money-form", "submit", (ev) => run(ev, async (form) => {
    const kind = value(form, "kind");
    const body = { amount_usd: Number(value(form, "amount_usd")) };
    if (kind !== "credit") body.reason = value(form, "reason");
    const out = await post(`${API}/accounts/${enc(st.account)}/${kind}`, body);
    form.reset();
    selectAllowed(form.elements.namedItem("kind"));
    const verb = { credit: "credited", debit: "debited", refund: "refunded" }[kind];
    notice(`Account ${out.id} ${verb} ${usd(Math.round(body.amount_usd * 1e6))}: its balance is ${usd(out.balance_micros)}.`);
    await refresh();
  }));
  for (const button of document.querySelectorAll("#status-form [data-status]")) {
    button.addEventListener("click", (ev) => run(ev, async (form) => status(st, form, button.dataset.status, refresh)),
      { signal: ctl.signal });
  }
  on("#key-new", "submit", (ev) => run(ev, async (form) => {
    const body = { account: st.account, ...present(keyFields(form)) };
    if (body.spend_cap_usd === undefined) delete body.spend_cap_period;
    const out = await post(`${API}/keys`, body);
    form.reset();
    showSecret(out, `Copy the new key ${out.id} now: it is not shown again.`);
    await Promise.all([loadKeys(st), refreshTable()]);
  }));
  on("#key-edit", "submit", (ev) => run(ev, async (form) => {
    const body = changes(st.key, form);
    if (!Object.keys(body).length) throw new Error("Nothing changed.");
    const out = await patch(`${API}/keys/${enc(st.key.id)}`, body);
    notice(`Key ${out.id} saved.`);
    await loadKeys(st);
    openKey(st, out);
  }));
  on("#key-rotate", "submit", (ev) => run(ev, async (form) => {
    const grace = Number(value(form, "grace_s") || "0");
    const what = `Rotate key ${st.key.id}: it gets a new secret, and the old one keeps working ${grace} more seconds?`;
    if (!(await confirmAction(what, "Rotate"))) return;
    const out = await post(`${API}/keys/${enc(st.key.id)}/rotate`, { grace_s: grace });
    showSecret(out, `Copy the rotated key ${out.id} now: it is not shown again.`);
    await loadKeys(st);
  }));
  on("#key-revoke", "submit", (ev) => run(ev, async (form) => {
    if (!(await confirmAction(`Revoke key ${st.key.id} for good? Requests with it are refused within a second.`, "Revoke"))) return;
    const reason = value(form, "reason");
    const out = await post(`${API}/keys/${enc(st.key.id)}/revoke`, reason ? { reason } : {});
    form.reset();
    notice(`Key ${out.id} revoked.`);
    closeKey(st);
    await loadKeys(st);
  }));
  on("#secret-done", "click", clearSecret);
  on("#panel-close", "click", () => closeAccount(st));
  on("#key-panel-close", "click", () => closeKey(st));

  return {
    // the accounts list's answer: the actions allowed, and a fresher view of the open account
    update(doc) {
      st.allowed = new Set(doc.allowed || []);
      // (the status buttons and the new key form also depend on the account: renderAccount)
      for (const el of document.querySelectorAll("#page-money [data-needs]:not([data-status]):not(#key-new)")) {
        const ok = st.allowed.has(el.dataset.needs);
        el.hidden = !ok;
        if (el.tagName === "OPTION") el.disabled = !ok;
      }
      selectAllowed($("#money-kind"));
      $("#money-form").hidden = !["account.credit", "account.debit", "account.refund"].some((a) => st.allowed.has(a));
      const acc = doc.data.find((a) => a.id === st.account);
      if (acc) renderAccount(st, acc);
    },
    // the account cell of the table: a button opening its panel when the session may read it
    cell(account) {
      if (!st.allowed.has("account.read")) return td(account);
      return h("td", {}, h("button", { type: "button", class: "link", "data-action": "manage",
        "aria-label": `Manage account ${account}`, onclick: () => open(st, account) }, account));
    },
    unmount() {
      ctl.abort();
      closeAccount(st);
    },
  };
}

// -- the account panel ------------------------------------------------------------------

async function open(st, account) {
  st.account = account;
  closeKey(st);
  clearSecret();
  for (const form of document.querySelectorAll("#account-panel form")) {
    form.reset();
    showError(form, "");
  }
  selectAllowed($("#money-kind"));
  $("#panel-account").textContent = account;
  $("#account-panel").hidden = false;
  $("#panel-title").focus();
  try {
    await Promise.all([loadAccount(st), loadKeys(st)]);
  } catch (err) {
    notice(`Could not open account ${account}: ${err.message}`);
  }
}

function closeAccount(st) {
  clearSecret();
  closeKey(st);
  st.account = null;
  $("#account-panel").hidden = true;
}

async function loadAccount(st) {
  const account = st.account;
  const doc = await get(`${API}/accounts/${enc(account)}`);
  if (st.account === account) renderAccount(st, doc);
}

function renderAccount(st, a) {
  $("#panel-status").textContent = a.status;
  $("#panel-status").dataset.status = a.status;
  const rows = [
    ["Balance", usd(a.balance_micros)], ["Open holds", usd(a.open_holds_micros)],
    ["Reconciling", usd(a.reconciling_micros)], ["Spent", usd(a.spent_micros)],
    ["Credited", usd(a.credited_micros)], ["Created", stamp(a.created_at)],
  ];
  if (a.status_reason) rows.push(["Reason", a.status_reason]);
  $("#panel-kv").replaceChildren(...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { "data-field": k.toLowerCase() }, v)]));
  const shows = { suspend: a.status === "active", resume: a.status === "suspended", close: a.status !== "closed" };
  for (const b of document.querySelectorAll("#status-form [data-status]")) {
    b.hidden = !st.allowed.has(b.dataset.needs) || !shows[b.dataset.status];
  }
  $("#status-form").hidden = a.status === "closed" || !["account.suspend", "account.resume", "account.close"].some((x) => st.allowed.has(x));
  $("#key-new").hidden = a.status === "closed" || !st.allowed.has("key.create");
}

async function status(st, form, verb, refresh) {
  const account = st.account;
  if (verb !== "resume") {
    const what = verb === "close"
      ? `Close account ${account} for good? Its keys are revoked; requests running now finish. This cannot be undone.`
      : `Suspend account ${account}? Its keys are refused new requests until it is resumed.`;
    if (!(await confirmAction(what, verb === "close" ? "Close account" : "Suspend"))) return;
  }
  const reason = value(form, "reason");
  const out = await post(`${API}/accounts/${enc(account)}/${verb}`, reason ? { reason } : {});
  form.reset();
  if (verb === "close") {
    notice(`Account ${out.id} closed: its balance is ${usd(out.balance_micros)} (open holds ${usd(out.open_holds_micros)}, reconciling ${usd(out.reconciling_micros)}); ${out.revoked_keys} keys revoked.`);
  } else {
    notice(`Account ${out.id} is ${out.status}.`);
  }
  await Promise.all([refresh(), loadKeys(st)]);
}

// -- keys -------------------------------------------------------------------------------

async function loadKeys(st) {
  const account = st.account;
  const doc = await get(`${API}/keys` + query({ account, limit: 500 }));
  if (st.account !== account) return;
  st.keys = doc.data;
  const manage = ["key.update", "key.rotate", "key.revoke"].some((a) => st.allowed.has(a));
  replaceRows($("#keys tbody"), doc.data.map((k) =>
    h("tr", { "data-key": k.id, "data-state": k.state },
      h("td", { class: "mono", title: k.id }, short(k.id)),
      td(k.name),
      td(k.state),
      td(k.products === null ? "all" : k.products.join(", ") || "none"),
      td(k.rpm, "num"), td(k.tpm, "num"), td(k.max_streams, "num"),
      td(k.spend_cap_micros === null ? null : `${usd(k.spend_cap_micros)} / ${k.spend_cap_period}`, "num"),
      td(usd(k.spend_micros), "num"),
      td(k.expires_at ? stamp(k.expires_at) : "never"),
      td(k.last_used_at ? stamp(k.last_used_at) : "never"),
      h("td", {}, manage && k.state !== "revoked"
        ? h("button", { type: "button", class: "secondary", "data-action": "key", onclick: () => openKey(st, k) }, "Manage")
        : "—"),
    )), "No keys.");
  if (st.key && !doc.data.some((k) => k.id === st.key.id && k.state !== "revoked")) closeKey(st);
}

function openKey(st, k) {
  st.key = k;
  $("#key-panel-id").textContent = k.id;
  $("#key-panel-state").textContent = k.state;
  const form = $("#key-edit");
  const set = (name, v) => { form.elements.namedItem(name).value = v === null || v === undefined ? "" : String(v); };
  set("name", k.name);
  set("products", k.products === null ? "" : k.products.join(", "));
  set("rpm", k.rpm);
  set("tpm", k.tpm);
  set("max_streams", k.max_streams);
  set("spend_cap_usd", k.spend_cap_micros === null ? null : k.spend_cap_micros / 1e6);
  set("spend_cap_period", k.spend_cap_period || "total");
  set("expires_at", minute(k.expires_at));
  for (const f of document.querySelectorAll("#key-panel form")) showError(f, "");
  $("#key-panel").hidden = false;
  $("#key-title").focus();
}

function closeKey(st) {
  st.key = null;
  $("#key-panel").hidden = true;
}

function keyFields(form) {
  const text = (name) => value(form, name);
  const num = (name) => (text(name) === "" ? null : Number(text(name)));
  const products = text("products");
  const expires = text("expires_at");
  return {
    name: text("name") || null,
    products: products === "" ? null : products.split(",").map((p) => p.trim()).filter(Boolean),
    rpm: num("rpm"),
    tpm: num("tpm"),
    max_streams: num("max_streams"),
    spend_cap_usd: num("spend_cap_usd"),
    spend_cap_period: text("spend_cap_period"),
    expires_at: expires === "" ? null : Date.parse(expires + "Z") / 1000,
  };
}

// The fields of the edit form that differ from the key: null clears one.
function changes(k, form) {
  const v = keyFields(form);
  const same = (a, b) => JSON.stringify(a ?? null) === JSON.stringify(b ?? null);
  const out = {};
  for (const name of ["name", "products", "rpm", "tpm", "max_streams"]) {
    if (!same(k[name], v[name])) out[name] = v[name];
  }
  if (!same(k.spend_cap_micros === null ? null : k.spend_cap_micros / 1e6, v.spend_cap_usd)) out.spend_cap_usd = v.spend_cap_usd;
  if (v.spend_cap_usd !== null && v.spend_cap_period !== (k.spend_cap_period || "total")) {
    out.spend_cap_period = v.spend_cap_period;
  }
  if (value(form, "expires_at") !== minute(k.expires_at)) out.expires_at = v.expires_at;
  return out;
}

// -- the secret box ---------------------------------------------------------------------

function showSecret(doc, title) {
  $("#secret-title").textContent = title;
  $("#secret-key").textContent = doc.key;
  $("#secret-webhook").textContent = doc.webhook_secret || "";
  $("#secret-webhook-row").hidden = !doc.webhook_secret;
  $("#secret-box").hidden = false;
  $("#secret-done").focus();
}

function clearSecret() {
  $("#secret-key").textContent = "";
  $("#secret-webhook").textContent = "";
  $("#secret-box").hidden = true;
}

// -- forms ------------------------------------------------------------------------------

function value(form, name) {
  return form.elements.namedItem(name).value.trim();
}

// Only the fields given (a null or undefined field is left out).
function present(fields) {
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== null && v !== undefined));
}

function minute(t) {
  return t ? new Date(t * 1000).toISOString().slice(0, 16) : "";
}

function selectAllowed(select) {
  if (select.selectedOptions[0] && !select.selectedOptions[0].disabled) return;
  const first = [...select.options].find((o) => !o.disabled);
  if (first) select.value = first.value;
}
