// Preloaded into Portkey's gateway (node --import) by bench/harness.py.
// Portkey 1.15.x on Node 20 fails every streamed chat completion with
// "TypeError: immutable" (Portkey-AI/gateway#1389, #1550): it appends headers to the
// Response that fetch() returned, whose headers are immutable. Re-wrapping fetch's
// answer in a new Response (same status, headers and body stream, not copied) makes
// them mutable; the cost is one object per request.
const upstreamFetch = globalThis.fetch;
globalThis.fetch = async (...args) => {
  const r = await upstreamFetch(...args);
  return new Response(r.body, { status: r.status, statusText: r.statusText, headers: r.headers });
};
