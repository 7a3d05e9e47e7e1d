-- wrk script for the non-streamed scenarios: POSTs a fixed chat completion body and,
-- when done, prints one line "WRKJSON {...}" with counts and exact latency percentiles
-- (microseconds) for bench/harness.py to parse.
--
--   BENCH_BODY     the request body (JSON text)
--   BENCH_HEADERS  extra request headers, one "Name: value" a line (e.g. authorization)

wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY") or '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
wrk.headers["Content-Type"] = "application/json"
local extra = os.getenv("BENCH_HEADERS") or ""
for line in extra:gmatch("[^\n]+") do
  local name, value = line:match("^%s*([^:]+):%s*(.-)%s*$")
  if name then
    wrk.headers[name] = value
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,'
      .. '"err_write":%d,"err_status":%d,"err_timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,'
      .. '"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
