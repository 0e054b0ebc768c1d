-- Extend the lock of an InProgress record still held by the given owner.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the owner token of the request that holds the lock
-- ARGV[2]  the new lock TTL in milliseconds, counted from now (a positive integer)
--
-- Returns 1 when the TTL was reset, 0 when the key is absent, held by another owner or no
-- longer InProgress. A stored value that is not a JSON object with a string ownerToken is
-- an error reply.
local current = redis.call('GET', KEYS[1])
if not current then
    return 0
end
local ok, stored = pcall(cjson.decode, current)
if not ok or type(stored) ~= 'table' or type(stored.ownerToken) ~= 'string' then
    return redis.error_reply('ERR malformed idempotency record at ' .. KEYS[1])
end
if stored.ownerToken ~= ARGV[1] or stored.status ~= 'InProgress' then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
