// A confirmation dialog (a native <dialog>: focus moves into it, Escape cancels).

import { $ } from "./dom.js";

export function confirmAction(text, verb) {
  const dialog = $("#confirm");
  $("#confirm-title").textContent = `${verb}?`;
  $("#confirm-text").textContent = text;
  $("#confirm-yes").textContent = verb;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    $("#confirm-no").focus();
  });
}
