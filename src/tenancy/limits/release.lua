-- Take back an admission whose answer never arrived (the call timed out or
-- failed): if admit.lua ran for this id, give back everything it took; if it
-- has not run yet, leave `released` in its record so that it takes nothing
-- when it does. Runs at most once per id: a second call finds `released`.
--
-- KEYS: as in admit.lua.
-- ARGV: scopes, tokens, window (µs), cost (nano-USD), record TTL (ms),
-- admission id; then four per scope: requests per window, tokens per window,
-- holds a lease (0/1), has budgets (0/1).
-- Returns 1 when an admission was taken back, 0 when there was none.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, tokens, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, keep, aid = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local state = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'released', 'PX', keep)
if state ~= 'admitted' then return 0 end
local function refund(key, limit, units)
  if limit <= 0 or units <= 0 then return end
  local tat = tonumber(redis.call('GET', key) or '0')
  local new = math.max(tat - units * math.max(1, math.floor(W / limit)), now)
  redis.call('SET', key, string.format('%d', new), 'PX', math.floor((new - now) / 1000) + 1000)
end
for i = 0, n - 1 do
  local k, a = 1 + i * 5, 6 + i * 4
  refund(KEYS[k + 1], tonumber(ARGV[a + 1]), 1)
  refund(KEYS[k + 2], tonumber(ARGV[a + 2]), tokens)
  if tonumber(ARGV[a + 3]) == 1 then redis.call('ZREM', KEYS[k + 3], aid) end
  if tonumber(ARGV[a + 4]) == 1 and cost > 0 then
    for _, key in ipairs({KEYS[k + 4], KEYS[k + 5]}) do
      if redis.call('DECRBY', key, cost) < 0 then redis.call('SET', key, '0', 'KEEPTTL') end
    end
  end
end
return 1
