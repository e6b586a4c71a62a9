-- KEYS[1] model slot   ARGV: prefix, chain hex, member, index key suffix
-- The key leaves the backend id's index too, which otherwise would grow with every
-- key ever advertised for as long as the backend keeps advertising (its expiry is
-- refreshed on each call). Instances of one backend id never overlap: a new one
-- purges its predecessor's entries before it advertises or withdraws anything.
local prefix, chain, member, idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local kind = ARGV[5] or 'k:'  -- 'd:' for the disk tier's key sets
for i = 0, #chain / 16 - 1 do
  local hex = string.sub(chain, i * 16 + 1, i * 16 + 16)
  redis.call('SREM', prefix .. kind .. hex, member)
  redis.call('SREM', prefix .. idx, hex)
end
return 1
