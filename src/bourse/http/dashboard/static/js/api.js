// Calls to the gateway's dashboard routes. The session is the HttpOnly cookie the
// browser sends by itself; actions add the session's CSRF token in a header.

let csrf = null;

export function setCsrf(token) {
  csrf = token;
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function call(method, path, body) {
  const headers = { accept: "application/json" };
  if (method !== "GET") {
    headers["content-type"] = "application/json";
    if (csrf) headers["x-csrf-token"] = csrf;
  }
  const resp = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
    cache: "no-store",
  });
  let doc = null;
  try {
    doc = await resp.json();
  } catch {
    doc = null;
  }
  if (!resp.ok) {
    const err = (doc && doc.error) || {};
    if (resp.status === 401) document.dispatchEvent(new CustomEvent("bourse:signed-out"));
    throw new ApiError(resp.status, err.code || "error", err.message || `HTTP ${resp.status}`);
  }
  return doc;
}

export const get = (path) => call("GET", path);
export const post = (path, body) => call("POST", path, body === undefined ? {} : body);
export const patch = (path, body) => call("PATCH", path, body);
export const put = (path, body) => call("PUT", path, body);
export const del = (path) => call("DELETE", path);

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? "?" + s : "";
}

// A live feed: an EventSource that opens again when the server ends the stream
// (it does every few minutes, re-checking the session) and stops on close().
export function feed(path, handlers, onState) {
  let source = null;
  let closed = false;
  let retry = null;
  const open = () => {
    if (closed) return;
    source = new EventSource(path);
    source.addEventListener("open", () => onState && onState(true));
    for (const [name, fn] of Object.entries(handlers)) {
      source.addEventListener(name, (ev) => fn(JSON.parse(ev.data)));
    }
    source.addEventListener("end", () => {
      source.close();
      open();
    });
    source.addEventListener("error", () => {
      if (onState) onState(false);
      if (source.readyState === EventSource.CLOSED && !closed) {
        retry = setTimeout(open, 3000);
      }
    });
  };
  open();
  return {
    close() {
      closed = true;
      if (retry) clearTimeout(retry);
      if (source) source.close();
    },
  };
}
