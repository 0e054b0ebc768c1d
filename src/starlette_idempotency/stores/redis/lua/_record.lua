-- Prepended to the scripts that read the stored record (see _NEEDS_RECORD_PRELUDE).
--
-- load_record() returns the record under KEYS[1] decoded from its JSON wire form, and the value
-- itself, or nil when the key is absent. A value that is not a JSON object with a string
-- ownerToken raises an error reply.
local function load_record()
    local current = redis.call('GET', KEYS[1])
    if not current then
        return nil
    end
    local ok, stored = pcall(cjson.decode, current)
    if not ok or type(stored) ~= 'table' or type(stored.ownerToken) ~= 'string' then
        error({err = 'ERR malformed idempotency record at ' .. KEYS[1]})
    end
    return stored, current
end

-- now_ms() is the server's clock (TIME) in epoch milliseconds: every lease is set and judged on
-- it, never on the clock of the pod that asks.
local function now_ms()
    local time = redis.call('TIME')
    return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- with_lease(value, lease_until, owner) is the JSON value of a record with recovery points whose
-- lockedUntil is lease_until (epoch ms) and, when owner is given, whose ownerToken is owner. The
-- value is edited as text, so the checkpoints' own data is never decoded and encoded again:
-- the record's wire form writes ownerToken, then lockedUntil, then checkpoints (the only user
-- data that could hold those names as keys), and no JSON string holds them unescaped, so the
-- first of each is the record's own.
local function with_lease(value, lease_until, owner)
    local lease_at = string.find(value, '"lockedUntil":', 1, true)
    local rest = string.find(value, ',', lease_at, true)
    local head = string.sub(value, 1, lease_at - 1)
    if owner then
        head = string.sub(value, 1, string.find(value, '"ownerToken":', 1, true) - 1)
            .. '"ownerToken":' .. cjson.encode(owner) .. ','
    end
    return head .. '"lockedUntil":' .. string.format('%.0f', lease_until) .. string.sub(value, rest)
end

-- set_keeping_ttl(value, at_least) writes value over KEYS[1], keeping the key's TTL, or, when
-- at_least (milliseconds) is given and the TTL is shorter, for at_least from now: a record is
-- never dropped before the end of the lease it is given. Only a key kept without a TTL (-1)
-- stays without one: in a key's last millisecond PTTL is 0, and the key is still there.
local function set_keeping_ttl(value, at_least)
    local ttl = redis.call('PTTL', KEYS[1])
    if ttl == -1 then
        redis.call('SET', KEYS[1], value)
    else
        ttl = math.max(ttl, at_least or 0, 1)
        redis.call('SET', KEYS[1], value, 'PX', string.format('%.0f', ttl))
    end
end

