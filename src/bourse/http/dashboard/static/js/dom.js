// DOM building and number formatting. Elements are built with createElement and
// textContent only: no HTML is ever parsed from strings (the page runs under
// Trusted Types with no policy: assigning markup to an element would throw).

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const $ = (sel, root = document) => root.querySelector(sel);

export function replaceRows(tbody, rows, empty) {
  tbody.replaceChildren(...rows);
  const heads = headings(tbody.closest("table"));
  for (const tr of rows) labelRow(tr, heads);
  if (!rows.length && empty) {
    const cols = heads.length || 1;
    tbody.append(h("tr", { class: "empty" }, h("td", { colspan: cols, class: "muted" }, empty)));
  }
}

// Each cell names its column (data-label, the text of its heading) for the narrow
// layout (app.css), where a table's row is shown as lines of "column value".
export function headings(table) {
  return [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
}

export function labelRow(tr, heads) {
  let i = 0;
  for (const cell of tr.cells) {
    if (cell.colSpan === 1 && heads[i] && !cell.hasAttribute("data-label")) cell.setAttribute("data-label", heads[i]);
    i += cell.colSpan;
  }
}

export function td(value, cls) {
  return h("td", cls ? { class: cls } : {}, value === null || value === undefined ? "—" : value);
}

export function usd(micros) {
  if (micros === null || micros === undefined) return "—";
  const sign = micros < 0 ? "-" : "";
  const abs = Math.abs(micros);
  const whole = Math.floor(abs / 1e6).toLocaleString("en-US");
  const frac = String(abs % 1e6).padStart(6, "0");
  return `${sign}$${whole}.${frac}`;
}

export function price(p) {
  if (p === null || p === undefined) return "—";
  const s = Number(p.toPrecision(4)).toString();
  const decimals = s.includes(".") ? s.split(".")[1].length : 0;
  return "$" + (decimals < 2 && !s.includes("e") ? p.toFixed(2) : s);
}

export function ms(v) {
  if (v === null || v === undefined) return "—";
  return v >= 1000 ? (v / 1000).toFixed(2) + " s" : Math.round(v) + " ms";
}

export function secs(v) {
  if (v === null || v === undefined) return "—";
  return v >= 10 ? v.toFixed(0) + " s" : v.toFixed(2) + " s";
}

export function clock(t) {
  if (!t) return "—";
  const d = new Date(t * 1000);
  return d.toLocaleTimeString("en-GB", { hour12: false });
}

export function stamp(t) {
  if (!t) return "—";
  return new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

export function short(id) {
  if (!id) return "—";
  return id.length > 18 ? id.slice(0, 10) + "…" + id.slice(-6) : id;
}

export function notice(text) {
  const el = $("#notice");
  el.textContent = text || "";
  el.hidden = !text;
}
