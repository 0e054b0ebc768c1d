-- A unique Idempotency-Key on every request: "<run id>-<thread>-<counter>".
-- Usage: wrk ... -s unique.lua URL -- <run id> [<body>]  (the body defaults to common.lua's)
dofile(string.gsub(debug.getinfo(1, "S").source, "^@(.*/)[^/]*$", "%1") .. "common.lua")

counter = 0
thread_id = thread_id or 0
local run_id = "run"

function init(args)
    run_id = args[1] or run_id
    wrk.body = args[2] or wrk.body
end

function request()
    counter = counter + 1
    wrk.headers["Idempotency-Key"] = run_id .. "-" .. thread_id .. "-" .. counter
    return wrk.format()
end
