-- Take an idempotency key if it is free, reading and writing in one step.
--
-- KEYS[1]  the storage key ("<prefix>:<key>")
-- ARGV[1]  the pending InProgress record, in its JSON wire form
-- ARGV[2]  the lock TTL in milliseconds (a positive integer)
--
-- Returns nil when the key was free and now holds ARGV[1] (acquired), else the value that
-- holds the key, untouched. An expired key is absent to Redis, so it counts as free.
local current = redis.call('GET', KEYS[1])
if current then
    return current
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return nil
