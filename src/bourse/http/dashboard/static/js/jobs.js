// The jobs page: jobs by state with their progress (place in the book while queued,
// tokens while running); cancel for the owner, the admin key or an admin operator.

import { get, post, query } from "./api.js";
import { $, h, notice, replaceRows, short, stamp, td } from "./dom.js";
import { confirmAction } from "./confirm.js";

const REFRESH_MS = 2000;
const FINAL = new Set(["succeeded", "failed", "canceled", "expired"]);

export function mount(ctx) {
  const mayCancel = ctx.session.actions.includes("job.cancel");
  const status = $("#jobs-status");
  let timer = null;
  let alive = true;

  const refresh = async () => {
    try {
      const doc = await get("/dashboard/api/jobs" + query({ status: status.value }));
      replaceRows($("#jobs tbody"), doc.data.map((j) => row(j, mayCancel, refresh)), "No jobs.");
    } catch (err) {
      notice(err.message);
    }
  };
  const loop = async () => {
    await refresh();
    if (alive) timer = setTimeout(loop, REFRESH_MS);
  };
  status.addEventListener("change", refresh);
  loop();
  return () => {
    alive = false;
    clearTimeout(timer);
    status.removeEventListener("change", refresh);
  };
}

function progress(j) {
  if (j.progress) {
    const max = j.progress.max_tokens || 1;
    return h("span", {},
      h("progress", { max, value: j.progress.tokens, "aria-label": `${j.progress.tokens} of ${max} tokens` }),
      ` ${j.progress.tokens} / ${max} tokens`);
  }
  if (j.queue) return `position ${j.queue.position} in the book (bid ${j.queue.bid}, level ${j.queue.level})`;
  if (j.error && j.error.error) return j.error.error.code || "failed";
  return FINAL.has(j.status) ? "—" : "…";
}

function row(j, mayCancel, refresh) {
  const cancel = async () => {
    if (!(await confirmAction(`Cancel job ${j.id} of account ${j.account}?`, "Cancel job"))) return;
    try {
      const out = await post(`/dashboard/api/jobs/${encodeURIComponent(j.id)}/cancel`);
      notice(`Job ${out.id} is ${out.status}.`);
    } catch (err) {
      notice(`Could not cancel job ${j.id}: ${err.message}`);
    }
    await refresh();
  };
  return h("tr", { "data-job": j.id, "data-status": j.status },
    h("td", { class: "mono", title: j.id }, short(j.id)),
    td(j.account),
    td(j.model),
    td(j.status),
    h("td", {}, progress(j)),
    td(stamp(j.created_at)),
    h("td", {}, FINAL.has(j.status) || !mayCancel ? "—" : h("button", { type: "button", class: "danger", onclick: cancel }, "Cancel")),
  );
}
