-- wrk script for ops/bench.sh: one of cobro's hot paths per run, chosen by
-- BENCH_MODE (set by bench.sh, like the other BENCH_* variables):
--   new     POST /v1/payments, a new Idempotency-Key and order_ref every request
--   replay  POST /v1/payments with one fixed, already completed key
--   get     GET /v1/payments/{BENCH_PAYMENT}
--   healthz GET /healthz (no SQL: the HTTP floor)
-- done() prints one line "BENCH_RESULT {json}" for bench.sh to collect.

local mode = os.getenv("BENCH_MODE") or "new"
local token = os.getenv("BENCH_TOKEN")
local prefix = os.getenv("BENCH_PREFIX") or "bench"
local replay_key = os.getenv("BENCH_KEY")
local replay_order = os.getenv("BENCH_ORDER")
local payment = os.getenv("BENCH_PAYMENT")

local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local function body(order_ref)
  return '{"order_ref":"' .. order_ref .. '","amount":1999,"currency":"EUR",'
    .. '"payment_method":"pm_card_visa","description":"bench"}'
end

local fixed

function init(args)
  counter = 0
  if mode == "replay" then
    fixed = wrk.format("POST", "/v1/payments", {
      ["Authorization"] = "Bearer " .. token,
      ["Idempotency-Key"] = replay_key,
      ["Content-Type"] = "application/json",
    }, body(replay_order))
  elseif mode == "healthz" then
    fixed = wrk.format("GET", "/healthz")
  elseif mode == "get" then
    fixed = wrk.format("GET", "/v1/payments/" .. payment, {
      ["Authorization"] = "Bearer " .. token,
    })
  end
end

function request()
  if fixed then
    return fixed
  end
  counter = counter + 1
  local unique = prefix .. "-" .. thread_id .. "-" .. counter
  return wrk.format("POST", "/v1/payments", {
    ["Authorization"] = "Bearer " .. token,
    ["Idempotency-Key"] = "key-" .. unique,
    ["Content-Type"] = "application/json",
  }, body(unique))
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"rps":%.1f,'
      .. '"p50_ms":%.3f,"p90_ms":%.3f,"p99_ms":%.3f,"mean_ms":%.3f,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.mean / 1000,
    e.connect, e.read, e.write, e.status, e.timeout))
end
