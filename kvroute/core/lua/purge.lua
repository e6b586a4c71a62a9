-- Remove a backend id's advertisements by instances other than `keep` (all of
-- them when keep is empty), through the index of keys that backend id advertised.
--   KEYS[1] model slot   ARGV: prefix, index key suffix, member prefix "bid|", keep member
local prefix, idx, mine, keep = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local kind = ARGV[5] or 'k:'  -- 'd:' for the disk tier's key sets
local removed = 0
for _, hex in ipairs(redis.call('SMEMBERS', prefix .. idx)) do
  local k = prefix .. kind .. hex
  local still = false
  for _, m in ipairs(redis.call('SMEMBERS', k)) do
    if string.sub(m, 1, #mine) == mine then
      if m ~= keep then
        redis.call('SREM', k, m)
        removed = removed + 1
      else
        still = true
      end
    end
  end
  if not still then redis.call('SREM', prefix .. idx, hex) end
end
return removed
