-- Admit one request under a usage-limit subject's limits, or say which one it is over.
-- KEYS[1] the subject's `open` set   ARGV: prefix, requests/minute, tokens/minute,
-- tokens/day, concurrent requests (each 0: no such limit), request id, lease (ms).
-- The other keys are derived from the prefix: the same hash tag, the same slot.
-- Windows and leases run on the server's clock, so every proxy counts the same windows.
-- Returns {limit over, seconds until it may pass}; {"", 0} once admitted.
local prefix = ARGV[1]
local rpm, tpm, tpd, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease = tonumber(ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1])
local now_ms = now * 1000 + math.floor(tonumber(t[2]) / 1000)
local minute, day = math.floor(now / 60), math.floor(now / 86400)
local function used(key) return tonumber(redis.call('GET', key) or '0') end
if tpd > 0 and used(prefix .. 'tpd:' .. day) >= tpd then return {'tokens_per_day', 86400 - now % 86400} end
if tpm > 0 and used(prefix .. 'tpm:' .. minute) >= tpm then return {'tokens_per_minute', 60 - now % 60} end
local requests = prefix .. 'rpm:' .. minute
if rpm > 0 and used(requests) >= rpm then return {'requests_per_minute', 60 - now % 60} end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {'concurrent_requests', 1} end
  redis.call('ZADD', KEYS[1], now_ms + lease, ARGV[6])
  redis.call('PEXPIRE', KEYS[1], lease * 2)
end
if rpm > 0 then
  redis.call('INCR', requests)
  redis.call('EXPIRE', requests, 120)
end
return {'', 0}
