// The dashboard's entry point: the session (sign in, sign out), the page router
// (#market/<product>, #money, #requests, #jobs) and each page's lifecycle.

import { get, post, setCsrf } from "./api.js";
import { $, notice } from "./dom.js";
import * as jobs from "./jobs.js";
import * as market from "./market.js";
import * as money from "./money.js";
import * as requests from "./requests.js";

const PAGES = { market, money, requests, jobs };
let session = null;
let unmount = null;

function show(id) {
  for (const el of document.querySelectorAll("main > section")) el.hidden = el.id !== id;
}

function route() {
  if (unmount) {
    unmount();
    unmount = null;
  }
  notice("");
  if (!session) return;
  const [name, arg] = location.hash.replace(/^#/, "").split("/");
  const page = PAGES[name] ? name : "market";
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  show("page-" + page);
  document.title = `bourse · ${page}`;
  unmount = PAGES[page].mount({ session, arg: arg ? decodeURIComponent(arg) : null });
  const title = $(`#${page}-title`);
  if (title && document.activeElement !== $("#market-product")) title.focus({ preventScroll: true });
}

function signedIn(doc) {
  session = doc;
  setCsrf(doc.csrf);
  $("#nav").hidden = false;
  $("#who").hidden = false;
  $("#who-role").textContent = doc.staff
    ? `${doc.operator || "admin key"} · ${doc.role} · all accounts`
    : `account ${doc.account} · ${doc.key_id}`;
  route();
}

function signedOut(message) {
  if (unmount) {
    unmount();
    unmount = null;
  }
  session = null;
  setCsrf(null);
  $("#nav").hidden = true;
  $("#who").hidden = true;
  show("signin");
  const err = $("#signin-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("#signin-key").value = "";
  $("#signin-key").focus();
}

async function signIn(ev) {
  ev.preventDefault();
  const key = $("#signin-key").value;
  try {
    const resp = await fetch("/dashboard/api/session", {
      method: "POST",
      headers: { "content-type": "application/json", accept: "application/json" },
      body: JSON.stringify({ key }),
      credentials: "same-origin",
    });
    const doc = await resp.json();
    $("#signin-key").value = "";
    if (!resp.ok) {
      signedOut((doc.error && doc.error.message) || "Sign-in failed.");
      return;
    }
    $("#signin-error").hidden = true;
    signedIn(doc);
  } catch (err) {
    signedOut(String(err));
  }
}

async function signOut() {
  try {
    await post("/dashboard/api/session/end");
  } catch {
    // the session is gone either way
  }
  signedOut("Signed out.");
}

async function boot() {
  $("#signin-form").addEventListener("submit", signIn);
  $("#signout").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  document.addEventListener("bourse:signed-out", () => {
    if (session) signedOut("The session ended; sign in again.");
  });
  const doc = await get("/dashboard/api/session");
  if (doc.signed_in) signedIn(doc);
  else signedOut(location.hash === "#signin-failed" ? "That key is neither the admin key, an operator key nor an API key." : "");
}

boot();
