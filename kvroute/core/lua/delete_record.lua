-- Delete a record only if it still belongs to this instance (a new instance with
-- the same backend id may already have replaced it).
--   KEYS[1] record key   KEYS[2] (optional) zset of ids in the same slot
--   ARGV: backend id, instance id
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, rec = pcall(cjson.decode, raw)
  if not (ok and type(rec) == 'table' and rec.instance_id == ARGV[2]) then return 0 end
  redis.call('DEL', KEYS[1])
end
if KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[1]) end
return 1
