// A non-streamed request that times out in the book (HTTP 408 book_timeout), through the
// openai package with its default retries (2); prints the status, the x-should-retry
// header and how long the call took, as JSON.
// env BOURSE_URL (…/v1), BOURSE_KEY, BOURSE_MODEL
import OpenAI from "openai";

const sdk = new OpenAI({ baseURL: process.env.BOURSE_URL, apiKey: process.env.BOURSE_KEY });
const t0 = Date.now();
let out;
try {
  await sdk.chat.completions.create({
    model: process.env.BOURSE_MODEL,
    messages: [{ role: "user", content: "hi" }],
    timeout: 0.3,
  });
  out = { status: 200 };
} catch (error) {
  out = { status: error.status ?? null, shouldRetry: error.headers?.get?.("x-should-retry") ?? null };
}
out.elapsedMs = Date.now() - t0;
process.stdout.write(JSON.stringify(out) + "\n");
