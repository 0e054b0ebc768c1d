-- Save the owner's InProgress record with new recovery points, with its lease counted on the
-- server's clock.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the record, in its JSON wire form (with a lockedUntil, which is replaced)
-- ARGV[2]  the owner token of the request writing it
-- ARGV[3]  how long to keep the record, in milliseconds (a positive integer)
-- ARGV[4]  the lease in milliseconds from now (0 ends it now: a retry may recover at once)
--
-- Returns 1 when written, 0, writing nothing, when the key is absent, held by another owner or
-- no longer InProgress: a late write (a checkpoint after the response, a command resent after
-- a reconnect) never turns a finished record back.
local stored = load_record()
if stored == nil or stored.ownerToken ~= ARGV[2] or stored.status ~= 'InProgress' then
    return 0
end
redis.call('SET', KEYS[1], with_lease(ARGV[1], now_ms() + tonumber(ARGV[4])), 'PX', ARGV[3])
return 1
