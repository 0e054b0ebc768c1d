-- One Idempotency-Key on every request (the harness completes it once beforehand), so every
-- request is a replay. Usage: wrk ... -s replay.lua URL -- <key> [<body>]
dofile(string.gsub(debug.getinfo(1, "S").source, "^@(.*/)[^/]*$", "%1") .. "common.lua")

counter = 0
local payload = nil

function init(args)
    wrk.headers["Idempotency-Key"] = args[1] or "replayed-key"
    wrk.body = args[2] or wrk.body
    payload = wrk.format()
end

function request()
    counter = counter + 1
    return payload
end
