-- Delete the key if the given owner still holds it.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the owner token of the request giving the key up
-- ARGV[2]  the channel to PUBLISH a change notice on once deleted, so that duplicates waiting
--          in other processes wake up and may take the key
--
-- Returns 1 when the key is gone (deleted now, or already absent) and 0, deleting nothing,
-- when another owner holds it. A stored value that is not a JSON object with a string
-- ownerToken is an error reply.
local current = redis.call('GET', KEYS[1])
if not current then
    return 1
end
local ok, stored = pcall(cjson.decode, current)
if not ok or type(stored) ~= 'table' or type(stored.ownerToken) ~= 'string' then
    return redis.error_reply('ERR malformed idempotency record at ' .. KEYS[1])
end
if stored.ownerToken ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], '1')
return 1
