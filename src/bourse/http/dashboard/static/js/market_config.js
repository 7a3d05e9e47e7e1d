// The live market's configuration on the market page, for an operator whose role may
// change it (the session's `actions`): the product's default bid, each deployment's
// floor and slots, a product added (or replaced) from its table as JSON, and the
// product removed. Each change is previewed first (the route's dry run: one line per
// change, nothing written), then applied (the admin route's change, audited by the
// server, in force at once); the route's refusal (400 invalid_config naming the key)
// shows in the form. The forms read the tables in force from /dashboard/api/market.

import { del, get, patch, put } from "./api.js";
import { confirmAction } from "./confirm.js";
import { run, showError } from "./forms.js";
import { $, h, notice } from "./dom.js";

const API = "/dashboard/api";
const enc = encodeURIComponent;
const WRITES = ["market.product.edit", "market.product.put", "market.product.delete"];

// Mount the configuration card for `product`; `ctx.session` is the signed-in session
// (its `actions` and `products`). Returns the unmount function.
export function mount(ctx, product) {
  const card = $("#market-config");
  const actions = new Set(ctx.session.actions || []);
  card.hidden = !WRITES.some((a) => actions.has(a));
  if (card.hidden) return () => {};
  const ctl = new AbortController();
  const st = { ctx, product, actions, table: null, signal: ctl.signal };
  for (const el of card.querySelectorAll("[data-needs]")) el.hidden = !actions.has(el.dataset.needs);
  $("#config-product").textContent = product;

  const bid = $("#product-edit");
  previewed(bid, st, () => bidChanges(st, bid), (body) => editProduct(st, body));
  const add = $("#product-add");
  previewed(add, st, () => newProduct(add), (body) => putProduct(st, body));
  $("#product-remove").addEventListener("submit", (ev) => run(ev, () => removeProduct(st)), { signal: ctl.signal });

  load(st);
  return () => {
    ctl.abort();
    for (const form of card.querySelectorAll("form")) reset(form);
    $("#deployment-forms").replaceChildren();
  };
}

// -- reading the tables in force ---------------------------------------------------------

async function load(st) {
  try {
    const doc = await get(`${API}/market`);
    if (st.signal.aborted) return;
    st.table = doc.products[st.product] || null;
    $("#config-version").textContent = `version ${doc.version}, by ${doc.actor}`;
    fill(st);
  } catch (err) {
    if (!st.signal.aborted) showError($("#product-edit"), `The configuration could not be read: ${err.message}`);
  }
}

// The tables' values in the forms (a field a table leaves unset is empty: its default).
function fill(st) {
  const t = st.table || {};
  const bid = $("#product-edit");
  bid.elements.namedItem("default_bid").value = t.default_bid ?? "";
  const editable = st.actions.has("market.product.edit");
  const forms = (t.deployments || []).map((d, i) => deploymentForm(st, d, d.name || `${st.product}/${i}`));
  $("#deployment-forms").replaceChildren(...(editable ? forms : []));
}

function deploymentForm(st, dep, name) {
  const field = (label, key, attrs) =>
    h("label", {}, label, " ", h("input", { name: key, type: "number", value: dep[key] ?? "", ...attrs }));
  const form = h("form", { class: "filters manage config", "data-deployment": name, autocomplete: "off" },
    h("h3", { class: "row" }, "Deployment ", h("span", { class: "mono" }, name)),
    field("Floor (USD per 1M tokens)", "floor", { min: "0", step: "any", placeholder: "0" }),
    field("Slots", "slots", { min: "1", step: "1", placeholder: "the engine's" }),
    ...steps(),
  );
  previewed(form, st, () => {
    const changes = changed(dep, { floor: num(form, "floor"), slots: num(form, "slots") });
    return changes && { deployments: { [name]: changes } };
  }, (body) => editProduct(st, body));
  return form;
}

// -- the changes --------------------------------------------------------------------------

function bidChanges(st, form) {
  const changes = changed(st.table || {}, { default_bid: num(form, "default_bid") });
  return changes && { set: changes };
}

function newProduct(form) {
  const name = form.elements.namedItem("product").value.trim();
  if (!name) throw new Error("Name the product.");
  let table;
  try {
    table = JSON.parse(form.elements.namedItem("table").value);
  } catch (err) {
    throw new Error(`The table is not JSON: ${err.message}`);
  }
  if (table === null || typeof table !== "object" || Array.isArray(table)) {
    throw new Error('The table is a JSON object: {"deployments": [{"engine": "sim", ...}], ...}.');
  }
  return { name, product: table };
}

async function editProduct(st, body) {
  return patch(`${API}/products/${enc(st.product)}`, body);
}

async function putProduct(st, body) {
  const out = await put(`${API}/products/${enc(body.name)}`, { product: body.product, dry_run: body.dry_run });
  if (out.applied) {
    $("#product-add").reset();
    await products(st);
    await go("market/" + enc(body.name));
  }
  return out;
}

async function removeProduct(st) {
  const what = `Take ${st.product} off the exchange? New requests for it get model_not_found; what runs or waits there finishes.`;
  if (!(await confirmAction(what, "Remove product"))) return;
  const out = await del(`${API}/products/${enc(st.product)}`);
  const left = await products(st);
  await go("market/" + enc(left[0] || ""));
  report(out);
}

// Open another page (the router mounts it), then resolve.
function go(hash) {
  if (location.hash === "#" + hash) return Promise.resolve();
  return new Promise((resolve) => {
    window.addEventListener("hashchange", () => setTimeout(resolve), { once: true });
    location.hash = hash;
  });
}

// The products on the exchange now: the session's list and the product picker updated.
async function products(st) {
  const doc = await get(`${API}/session`);
  st.ctx.session.products = doc.products;
  const select = $("#market-product");
  const current = select.value;
  select.replaceChildren(...doc.products.map((p) => h("option", { value: p }, p)));
  if (doc.products.includes(current)) select.value = current;
  return doc.products;
}

// The fields that differ from `was` (an emptied field: null, back to the default).
function changed(was, now) {
  const out = {};
  for (const [key, value] of Object.entries(now)) {
    if ((was[key] ?? null) !== value) out[key] = value;
  }
  return Object.keys(out).length ? out : null;
}

// -- preview, then apply ------------------------------------------------------------------

// A form whose submit previews the change `body()` makes (a dry run, its lines shown)
// and whose Apply button writes it; editing the form again takes the preview away.
function previewed(form, st, body, send) {
  const apply = form.querySelector("[data-step='apply']");
  let pending = null;
  const stale = () => {
    pending = null;
    apply.hidden = true;
    showDiff(form, null);
  };
  form.addEventListener("input", stale, { signal: st.signal });
  form.addEventListener("submit", (ev) => run(ev, async () => {
    stale();
    const b = body();
    if (!b) throw new Error("Nothing changed.");
    const out = await send({ ...b, dry_run: true });
    showDiff(form, out.changes);
    if (out.changes.length) {
      pending = b;
      apply.hidden = false;
      apply.focus();
    }
  }), { signal: st.signal });
  apply.addEventListener("click", (ev) => run(ev, async () => {
    if (!pending) return;
    const out = await send(pending);
    stale();
    report(out);
    if (st.signal.aborted) return;
    await load(st);
  }), { signal: st.signal });
}

function report(out) {
  const head = out.applied ? `Market version ${out.version}: applied` : `Market version ${out.version}: nothing changed`;
  notice(out.changes.length ? `${head}: ${out.changes.join("; ")}.` : `${head}.`);
}

function steps() {
  return [
    h("button", { type: "submit", class: "secondary", "data-step": "preview" }, "Preview"),
    h("button", { type: "button", "data-step": "apply", hidden: true }, "Apply"),
    h("ul", { class: "diff row", "aria-label": "What the change does", hidden: true }),
    h("p", { class: "error", role: "alert", hidden: true }),
  ];
}

function showDiff(form, lines) {
  const ul = form.querySelector(".diff");
  if (!ul) return;
  ul.replaceChildren(...(lines || []).map((l) => h("li", {}, l)));
  if (lines && !lines.length) ul.append(h("li", { class: "muted" }, "No change."));
  ul.hidden = lines === null;
}

// -- forms --------------------------------------------------------------------------------

function num(form, name) {
  const v = form.elements.namedItem(name).value.trim();
  return v === "" ? null : Number(v);
}

function reset(form) {
  showError(form, "");
  showDiff(form, null);
  const apply = form.querySelector("[data-step='apply']");
  if (apply) apply.hidden = true;
}
