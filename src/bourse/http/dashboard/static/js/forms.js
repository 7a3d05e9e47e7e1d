// The dashboard's form runner, shared by the money page's management forms (manage.js)
// and the market page's configuration card (market_config.js): a form's action runs
// with its buttons disabled, and the route's refusal shows in the form's `.error` line.

// Show `message` in `form`'s error line (an empty message hides it).
export function showError(form, message) {
  const p = form.querySelector(".error");
  p.textContent = message;
  p.hidden = !message;
}

// Run a form's action: its buttons disabled meanwhile, the route's error shown in the form.
export async function run(ev, action) {
  ev.preventDefault();
  const form = ev.currentTarget.form || ev.currentTarget;
  const buttons = [...form.querySelectorAll("button")];
  showError(form, "");
  for (const b of buttons) b.disabled = true;
  try {
    await action(form);
  } catch (err) {
    showError(form, err.message);
  } finally {
    for (const b of buttons) b.disabled = false;
  }
}
