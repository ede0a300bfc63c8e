-- Settle one request that ended, once: replace its token reservation with the
-- tokens it used (charge beyond it, or give back the rest), give back its
-- request when the gateway refused it after admission, end its lease, and
-- replace its reserved cost with the real one. Its record turns `settled`, so
-- a retried call changes nothing; a `released` admission is left alone.
--
-- KEYS: as in admit.lua.
-- ARGV: scopes, token difference (used - reserved), window (µs), cost
-- difference (real - reserved, nano-USD), record TTL (ms), admission id, give
-- the request back (0/1); then four per scope: requests per window, tokens per
-- window, holds a lease (0/1), has budgets (0/1).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, diff, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, keep, aid, unrequest = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local state = redis.call('GET', KEYS[1])
if state == 'settled' or state == 'released' then return 0 end
redis.call('SET', KEYS[1], 'settled', 'PX', keep)
local function shift(key, limit, units)
  if limit <= 0 or units == 0 then return end
  local step = math.max(1, math.floor(W / limit))
  local tat = tonumber(redis.call('GET', key) or '0')
  local new
  if units > 0 then new = math.max(tat, now) + units * step else new = math.max(tat + units * step, now) end
  redis.call('SET', key, string.format('%d', new), 'PX', math.floor((new - now) / 1000) + 1000)
end
for i = 0, n - 1 do
  local k, a = 1 + i * 5, 7 + i * 4
  if unrequest == 1 then shift(KEYS[k + 1], tonumber(ARGV[a + 1]), -1) end
  shift(KEYS[k + 2], tonumber(ARGV[a + 2]), diff)
  if tonumber(ARGV[a + 3]) == 1 then redis.call('ZREM', KEYS[k + 3], aid) end
  if tonumber(ARGV[a + 4]) == 1 and cost ~= 0 then
    if redis.call('INCRBY', KEYS[k + 4], cost) < 0 then redis.call('SET', KEYS[k + 4], '0', 'KEEPTTL') end
    redis.call('EXPIRE', KEYS[k + 4], 2 * 86400)
    if redis.call('INCRBY', KEYS[k + 5], cost) < 0 then redis.call('SET', KEYS[k + 5], '0', 'KEEPTTL') end
    redis.call('EXPIRE', KEYS[k + 5], 32 * 86400)
  end
end
return 1
