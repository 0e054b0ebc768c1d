-- Give up a key whose acquire or takeover the caller abandoned (it will not run the handler):
-- delete it, or, for a record with recovery points, end its lease now (on the server's clock)
-- so that the next retry recovers at once with the checkpoints kept.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the owner token of the abandoned acquire
-- ARGV[2]  the channel to PUBLISH a change notice on, so that waiting duplicates look again
--
-- Returns 1 when the owner held the key, 0, changing nothing, when the key is absent, held by
-- another owner (the abandoned write never landed) or no longer InProgress.
local stored, current = load_record()
if stored == nil or stored.ownerToken ~= ARGV[1] or stored.status ~= 'InProgress' then
    return 0
end
if stored.lockedUntil ~= nil then
    set_keeping_ttl(with_lease(current, now_ms()))
else
    redis.call('DEL', KEYS[1])
end
redis.call('PUBLISH', ARGV[2], '1')
return 1
