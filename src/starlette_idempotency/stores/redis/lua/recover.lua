-- Decide, on the server's clock, whether a retry takes over an InProgress record with recovery
-- points whose handler died (its lease, lockedUntil, has run out), and take it over in the
-- same step: same record, the retry's owner token and a new lease, and the same TTL unless the
-- lease outlasts it (then the TTL runs to the lease's end: the retention may be almost over).
--
-- KEYS[1]  the storage key
-- ARGV[1]  the retry's request fingerprint
-- ARGV[2]  the retry's fingerprint version
-- ARGV[3]  the retry's owner token
-- ARGV[4]  the new lease in milliseconds (the lock TTL)
-- ARGV[5]  "1" to take over a record that may be, "0" only to tell whether its lease ran out
--
-- Returns {} when the key is absent, else {taken, value, lease_expired}: taken is 1 when the key
-- now holds the record under ARGV[3] (value: the record as it was before), 0 when it was left
-- untouched (value: what holds the key); lease_expired is 1 when value is an InProgress record
-- whose lease has run out.
local stored, current = load_record()
if stored == nil then
    return {}
end
local now = now_ms()
local lease = stored.lockedUntil
local expired = stored.status == 'InProgress' and type(lease) == 'number' and lease <= now
if not expired or ARGV[5] ~= '1' or stored.requestFingerprint ~= ARGV[1]
        or stored.fingerprintVersion ~= ARGV[2] then
    return {0, current, expired and 1 or 0}
end
local lease_ms = tonumber(ARGV[4])
set_keeping_ttl(with_lease(current, now + lease_ms, ARGV[3]), lease_ms)
return {1, current, 1}
