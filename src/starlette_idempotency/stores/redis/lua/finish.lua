-- Write a record over the key if its owner still holds it: a final (Completed or Failed)
-- record, or the owner's InProgress record with new recovery points or a new lease.
--
-- KEYS[1]  the storage key
-- ARGV[1]  the record to store, in its JSON wire form
-- ARGV[2]  the owner token of the request writing it
-- ARGV[3]  the TTL in milliseconds (a positive integer)
-- ARGV[4]  "1" to write when the key is absent too (complete, fail: the owner takes back a
--          key that vanished), "0" to write only over the owner's own record (save_progress)
-- ARGV[5]  the channel to PUBLISH a change notice on once written ("" for none), so that
--          duplicates waiting in other processes wake up
--
-- Returns 1 when the owner held the key and the record was written, 2 when the key was absent
-- and the record was written anyway (ARGV[4] = "1": the key was evicted, deleted, or its lock
-- expired), 0, writing nothing, when another owner holds the key (or, with ARGV[4] = "0", when
-- it is absent). The numbers are FencedWrite's. A malformed stored value is an error reply
-- (see _record.lua).
local stored = load_record()
local written = 1
if stored == nil then
    if ARGV[4] ~= '1' then
        return 0
    end
    written = 2
elseif stored.ownerToken ~= ARGV[2] then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
if ARGV[5] ~= '' then
    redis.call('PUBLISH', ARGV[5], '1')
end
return written
