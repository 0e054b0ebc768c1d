-- Claim an operation for one holder (an app, from its startup to its shutdown), or renew its
-- claim, unless a live claim of another holder names other code. Claims live in a hash of
-- their own, apart from the records: holder -> "<expiry in epoch ms>|<code>", each expiry on
-- the server's clock (TIME).
--
-- KEYS[1]  the operation's claims
-- ARGV[1]  the holder
-- ARGV[2]  the code that serves the operation (its handler's name)
-- ARGV[3]  how long the claim lives, in milliseconds from now (a positive integer)
--
-- Returns nil once claimed; else the code the other live claim names, claiming nothing. Claims
-- whose time has passed are dropped on the way.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl = tonumber(ARGV[3])
local claims = redis.call('HGETALL', KEYS[1])
for i = 1, #claims, 2 do
    local holder, claim = claims[i], claims[i + 1]
    local bar = string.find(claim, '|', 1, true)
    local code = string.sub(claim, bar + 1)
    if tonumber(string.sub(claim, 1, bar - 1)) <= now then
        redis.call('HDEL', KEYS[1], holder)
    elseif holder ~= ARGV[1] and code ~= ARGV[2] then
        return code
    end
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now + ttl) .. '|' .. ARGV[2])
if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
end
return nil
