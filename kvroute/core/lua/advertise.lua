-- KEYS[1] model slot   ARGV: prefix, chain hex, member, key ttl (s), index key suffix,
-- key-set kind ('k:' what the backend holds in RAM, 'd:' on its disk tier)
local prefix, chain, member, ttl, idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local kind = ARGV[6] or 'k:'
for i = 0, #chain / 16 - 1 do
  local hex = string.sub(chain, i * 16 + 1, i * 16 + 16)
  local k = prefix .. kind .. hex
  redis.call('SADD', k, member)
  redis.call('EXPIRE', k, ttl)
  redis.call('SADD', prefix .. idx, hex)
end
redis.call('EXPIRE', prefix .. idx, ttl)
return 1
