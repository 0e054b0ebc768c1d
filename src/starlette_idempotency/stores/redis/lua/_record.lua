-- Prepended to finish.lua, release.lua and renew.lua when they are loaded.
--
-- load_record() returns the record under KEYS[1] decoded from its JSON wire form, or nil when
-- the key is absent. A value that is not a JSON object with a string ownerToken raises an
-- error reply.
local function load_record()
    local current = redis.call('GET', KEYS[1])
    if not current then
        return nil
    end
    local ok, stored = pcall(cjson.decode, current)
    if not ok or type(stored) ~= 'table' or type(stored.ownerToken) ~= 'string' then
        error({err = 'ERR malformed idempotency record at ' .. KEYS[1]})
    end
    return stored
end

