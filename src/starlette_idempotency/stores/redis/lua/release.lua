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
local stored = load_record()
if stored == nil then
    return 1
end
if stored.ownerToken ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], '1')
return 1
