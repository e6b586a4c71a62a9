-- The lookup: one round trip answers "how deep does each live backend match".
--   KEYS[1] kvr:{m:<m>}:backends     ARGV[1] kvr:{m:<m>}:     ARGV[2] chain hex
-- Returns {record_json, depth, marked_depth, ...} for every live backend serving the
-- model (depth 0 included). A backend is live when its rec key exists; it holds key x
-- when the set of key x contains "<bid>|<instance id from its record>", and it is
-- marked on key x when the routing-mark zset of key x has an unexpired mark for <bid>.
-- depth = leading keys held, contiguous from key 0; marked_depth = leading keys held
-- or marked. The result is exactly that of walking the chain key by key and stopping
-- at the first key no backend still matches; to make the common case cheap, the walk
-- goes by chunks (8 keys, doubling up to 64): one SINTER tells which backends hold the
-- whole chunk, and only those that do not are walked key by key through it.
local prefix, chain = ARGV[1], ARGV[2]
local n = #chain / 16
local ids, members, raws = {}, {}, {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local raw = redis.call('GET', prefix .. 'rec:' .. id)
  -- orjson writes compact JSON and escapes quotes inside strings, so this pattern
  -- only matches the real field (cheaper than cjson.decode on every lookup).
  local iid = raw and string.match(raw, '"instance_id":"([^"]*)"')
  if iid then
    ids[#ids + 1] = id
    members[#members + 1] = id .. '|' .. iid
    raws[#raws + 1] = raw
  end
end
local depth, marked, adv, active = {}, {}, {}, {}
for j = 1, #ids do depth[j], marked[j], adv[j], active[j] = 0, 0, true, j end
local now = nil

-- Walk backends `w` (indexes) through key x alone; returns those still matching.
local function step(x, name, w)
  local wm = {}
  for y, j in ipairs(w) do wm[y] = members[j] end
  local held = redis.call('SMISMEMBER', name, unpack(wm))
  local marks, still = nil, {}
  for y, j in ipairs(w) do
    local ok = held[y] == 1
    if not ok then
      if adv[j] then adv[j] = false; depth[j] = x end
      if marks == nil then
        if now == nil then
          local t = redis.call('TIME')
          now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        end
        marks = {}
        local p = prefix .. 'p:' .. string.sub(chain, x * 16 + 1, x * 16 + 16)
        for _, id in ipairs(redis.call('ZRANGEBYSCORE', p, '(' .. now, '+inf')) do marks[id] = true end
      end
      ok = marks[ids[j]] == true
    end
    if ok then still[#still + 1] = j else marked[j] = x end
  end
  return still
end

local i, chunk = 0, 8
while i < n and #active > 0 do
  local last = math.min(n, i + chunk) - 1
  local names = {}
  for x = i, last do names[#names + 1] = prefix .. 'k:' .. string.sub(chain, x * 16 + 1, x * 16 + 16) end
  local whole = {}
  for _, m in ipairs(redis.call('SINTER', unpack(names))) do whole[m] = true end
  local keep, walkers = {}, {}
  for _, j in ipairs(active) do
    if whole[members[j]] then keep[#keep + 1] = j else walkers[#walkers + 1] = j end
  end
  for x = i, last do
    if #walkers == 0 then break end
    walkers = step(x, names[x - i + 1], walkers)
  end
  for _, j in ipairs(walkers) do keep[#keep + 1] = j end
  active = keep
  i = last + 1
  if chunk < 64 then chunk = chunk * 2 end
end
for _, j in ipairs(active) do
  marked[j] = i
  if adv[j] then depth[j] = i end
end
-- The disk tier: leading keys each backend holds in its 'd:' sets, key by key
-- (one SMISMEMBER per key; a fleet without disk tiers stops at key 0).
local disk, walking = {}, {}
for j = 1, #ids do disk[j] = 0; walking[j] = j end
local x = 0
while x < n and #walking > 0 do
  local wm = {}
  for y, j in ipairs(walking) do wm[y] = members[j] end
  local held = redis.call('SMISMEMBER', prefix .. 'd:' .. string.sub(chain, x * 16 + 1, x * 16 + 16), unpack(wm))
  local still = {}
  for y, j in ipairs(walking) do
    if held[y] == 1 then still[#still + 1] = j; disk[j] = x + 1 end
  end
  walking = still
  x = x + 1
end
local out = {}
for j = 1, #ids do
  out[#out + 1] = raws[j]
  out[#out + 1] = depth[j]
  out[#out + 1] = marked[j]
  out[#out + 1] = disk[j]
end
return out
