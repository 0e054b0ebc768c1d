-- Store a final (Completed or Failed) record if its owner still holds the key, or if nobody
-- does.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the record to store, in its JSON wire form
-- ARGV[2]  the owner token of the request writing it
-- ARGV[3]  the TTL in milliseconds (a positive integer)
-- ARGV[4]  the channel to PUBLISH a change notice on once written, so that duplicates waiting
--          in other processes wake up
--
-- Returns 1 when the owner held the key and the record was written, 2 when the key was absent
-- and the record was written anyway (the owner takes back a key that was evicted, deleted, or
-- whose lock expired), 0, writing nothing, when another owner holds the key. The numbers are
-- FencedWrite's. A malformed stored value is an error reply (see _record.lua).
local stored = load_record()
local written = 1
if stored == nil then
    written = 2
elseif stored.ownerToken ~= ARGV[2] then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('PUBLISH', ARGV[4], '1')
return written
