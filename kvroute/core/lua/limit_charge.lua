-- Charge the tokens of an ended request to its usage-limit subject's windows.
-- KEYS[1] the subject's `open` set (its slot)   ARGV: prefix, tokens, per minute (1/0), per day (1/0)
local prefix, tokens = ARGV[1], tonumber(ARGV[2])
local now = tonumber(redis.call('TIME')[1])
if ARGV[3] == '1' then
  local k = prefix .. 'tpm:' .. math.floor(now / 60)
  redis.call('INCRBY', k, tokens)
  redis.call('EXPIRE', k, 120)
end
if ARGV[4] == '1' then
  local k = prefix .. 'tpd:' .. math.floor(now / 86400)
  redis.call('INCRBY', k, tokens)
  redis.call('EXPIRE', k, 172800)
end
return 1
