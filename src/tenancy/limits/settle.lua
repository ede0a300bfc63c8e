-- Settle one request that ended: correct its token estimate (charge the tokens
-- it used beyond it, or give back the rest), release its slot, add its cost.
-- KEYS: five per scope, as in admit.lua.
-- ARGV: scopes, token difference (used - estimate), cost in nano-USD, window (µs);
-- then three per scope: tokens per window (0: none), holds a slot (0/1), has budgets (0/1).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, diff, nano, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 0, n - 1 do
  local k, a = i * 5, 4 + i * 3
  local tpm, slot, budgets = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  if tpm > 0 and diff ~= 0 then
    local step = math.max(1, math.floor(W / tpm))
    local tat = tonumber(redis.call('GET', KEYS[k + 2]) or '0')
    local new
    if diff > 0 then new = math.max(tat, now) + diff * step else new = math.max(tat + diff * step, now) end
    redis.call('SET', KEYS[k + 2], string.format('%d', new), 'PX', math.floor((new - now) / 1000) + 1000)
  end
  if slot == 1 and redis.call('DECR', KEYS[k + 3]) < 0 then
    redis.call('SET', KEYS[k + 3], '0')
  end
  if budgets == 1 and nano > 0 then
    redis.call('INCRBY', KEYS[k + 4], nano)
    redis.call('EXPIRE', KEYS[k + 4], 2 * 86400)
    redis.call('INCRBY', KEYS[k + 5], nano)
    redis.call('EXPIRE', KEYS[k + 5], 32 * 86400)
  end
end
return 1
