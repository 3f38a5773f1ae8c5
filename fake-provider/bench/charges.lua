-- wrk script for ops/bench-fake-provider.sh: every request is a new charge
-- with its own idempotency key and reference, so the provider does the full
-- work (key reservation, effect, ledger, stored answer) and never replays.
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

function init(args)
  counter = 0
  prefix = string.format("bench-%d-%d", thread_id, math.random(1, 1000000000))
end

function request()
  counter = counter + 1
  local key = prefix .. "-" .. counter
  local body = '{"amount":1250,"currency":"EUR","payment_method":"pm_card_visa","capture":true,"reference":"'
    .. key .. ':authorize-v1"}'
  return wrk.format("POST", "/v1/charges", {
    ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = key,
    ["Content-Type"] = "application/json",
  }, body)
end
