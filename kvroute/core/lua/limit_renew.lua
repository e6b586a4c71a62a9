-- Extend the leases of requests still in flight (a proxy that died stops renewing, and
-- its requests stop counting when their leases lapse).
-- KEYS[1] the subject's `open` set   ARGV: lease (ms), request ids...
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 1
