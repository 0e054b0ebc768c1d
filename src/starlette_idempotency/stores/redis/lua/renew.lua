-- Extend the lock of an InProgress record still held by the given owner: the key's TTL, or for
-- a record with recovery points its lease (lockedUntil, on the server's clock), keeping its
-- checkpoints as they are and its retention TTL unless the lease (or ARGV[3]) outlasts it: a
-- record is never dropped while its lease runs.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the owner token of the request that holds the lock
-- ARGV[2]  the new lock TTL in milliseconds, counted from now (an integer; for a record with
--          recovery points 0 ends its lease now, its TTL kept, so that a retry recovers at
--          once; a lock without a lease is kept at least 1 ms, as PEXPIRE 0 would delete it)
-- ARGV[3]  optional: for a record with recovery points, the retention in milliseconds from now
--          it is kept at least for (a TTL that runs longer is kept)
--
-- Returns 1 when extended, 0 when the key is absent, held by another owner or no longer
-- InProgress. A stored value that is not a JSON object with a string ownerToken is an error
-- reply.
local stored, current = load_record()
if stored == nil or stored.ownerToken ~= ARGV[1] or stored.status ~= 'InProgress' then
    return 0
end
if type(stored.lockedUntil) == 'number' then
    local lease_ms = tonumber(ARGV[2])
    local kept_ms = math.max(lease_ms, tonumber(ARGV[3] or 0))
    set_keeping_ttl(with_lease(current, now_ms() + lease_ms), kept_ms)
else
    redis.call('PEXPIRE', KEYS[1], math.max(1, tonumber(ARGV[2])))
end
return 1
