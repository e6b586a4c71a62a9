-- KEYS[1] model slot   ARGV: prefix, chain hex, backend id, ttl (ms)
-- Server time, so that marks expire by the same clock the lookup reads.
local prefix, chain, id, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 0, #chain / 16 - 1 do
  local k = prefix .. 'p:' .. string.sub(chain, i * 16 + 1, i * 16 + 16)
  redis.call('ZADD', k, 'GT', now + ttl, id)
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
return 1
