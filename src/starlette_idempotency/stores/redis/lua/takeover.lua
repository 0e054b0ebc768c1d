-- Replace a record only if the key still holds exactly the value the caller read
-- (compare-and-set on the whole value), keeping the key's TTL.
--
-- The store uses it to take over an InProgress record whose handler saved recovery points and
-- whose lease (lockedUntil, inside the value) has passed: the caller read the record, checked
-- that, and now swaps in the same record under its own owner token with a new lease. Comparing
-- the whole value makes the check and the swap one atomic step, without re-encoding the
-- checkpoints' user data here.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the value the caller read
-- ARGV[2]  the value to store instead
--
-- Returns 1 when swapped, 0 when the key changed (or vanished) since it was read.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
else
    redis.call('SET', KEYS[1], ARGV[2])
end
return 1
