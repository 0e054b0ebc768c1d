-- End one holder's claim on an operation (see claim.lua).
--
-- KEYS[1]  the operation's claims
-- ARGV[1]  the holder
--
-- Returns 1 when it had a claim, 0 when not.
return redis.call('HDEL', KEYS[1], ARGV[1])
