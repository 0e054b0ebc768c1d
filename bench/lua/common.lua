-- Shared by unique.lua and replay.lua (loaded with dofile): the POST request and a done()
-- that prints one machine-readable line for the harness:
--   BENCH_RESULT {"requests":...,"duration_us":...,"p50_us":...,"p99_us":...,
--                 "errors":{...},"keys_issued":...}
-- Latencies are wrk's own (microseconds). errors.status counts responses with status > 399.

wrk.method = "POST"
wrk.path = "/payments"
wrk.body = '{"accountId":"acct_1MqDcVKZ4aF9xQ2b","amount":12.5,"currency":"EUR",'
    .. '"merchantReference":"order-2026-000042"}'
wrk.headers["Content-Type"] = "application/json"

local threads = {}

function setup(thread)
    thread:set("thread_id", #threads)
    table.insert(threads, thread)
end

function done(summary, latency, requests)
    local issued = 0
    for _, thread in ipairs(threads) do
        issued = issued + (thread:get("counter") or 0)
    end
    local e = summary.errors
    io.write(string.format(
        'BENCH_RESULT {"requests":%d,"duration_us":%d,"bytes":%d,'
            .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d,'
            .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
            .. '"keys_issued":%d}\n',
        summary.requests, summary.duration, summary.bytes,
        latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency.mean, latency.max,
        e.connect, e.read, e.write, e.status, e.timeout, issued))
end
