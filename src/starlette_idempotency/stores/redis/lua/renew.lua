-- Extend the lock of an InProgress record still held by the given owner.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the owner token of the request that holds the lock
-- ARGV[2]  the new lock TTL in milliseconds, counted from now (a positive integer)
--
-- Returns 1 when the TTL was reset, 0 when the key is absent, held by another owner or no
-- longer InProgress. A stored value that is not a JSON object with a string ownerToken is
-- an error reply.
local stored = load_record()
if stored == nil or stored.ownerToken ~= ARGV[1] or stored.status ~= 'InProgress' then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
