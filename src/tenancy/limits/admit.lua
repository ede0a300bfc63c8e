-- Admit one request against every scope of it, atomically: check all, then
-- take from all. GCRA per limited quantity (the same arithmetic as gcra.rs),
-- concurrency leases (a sorted set of admission ids scored by expiry, pruned
-- here, so a slot whose request stopped renewing it frees itself), and the
-- spend sums of the day and month, which reserve the request's worst cost.
-- Time is Redis's own (TIME), so every replica reads the same clock.
--
-- Idempotent by admission id: KEYS[1] records it. A second run of the same id
-- takes nothing again; a release that ran first (release.lua, after a timeout)
-- left `released` there, and then this run takes nothing at all.
--
-- KEYS: the admission record, then five per scope: requests TAT, tokens TAT,
-- leases, day spend, month spend.
-- ARGV: scopes, tokens, window (µs), cost (nano-USD), lease (ms), record TTL
-- (ms), admission id; then five per scope: requests per window, tokens per window, max in
-- flight (0: none), daily and monthly budget in nano-USD (-1: none).
-- Returns {admitted, kind, scope, wait_µs, spent_nano,
--          req_limit, req_remaining, req_reset_µs, tok_limit, tok_remaining, tok_reset_µs}
-- (-1 where there is none); kind 1 requests, 2 tokens, 3 concurrency, 4 day,
-- 5 month, 6 released before it ran.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)
local n, tokens, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, lease, keep = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local aid = ARGV[7]
local function interval(limit) return math.max(1, math.floor(W / limit)) end
local function window(limit, tat)
  local used = math.max(0, tat - now)
  return {limit, math.floor(math.max(0, W - used) / interval(limit)), used}
end
local rq, tk = nil, nil
local function tighter(a, b) if a == nil or b[2] < a[2] then return b end return a end
local function answer(ok, kind, scope, wait, spent)
  local r = {ok, kind, scope, wait, spent}
  for _, w in ipairs({rq or {-1, -1, -1}, tk or {-1, -1, -1}}) do
    for _, v in ipairs(w) do table.insert(r, v) end
  end
  return r
end
local state = redis.call('GET', KEYS[1])
if state == 'released' then return answer(0, 6, -1, 0, 0) end
if state then return answer(1, 0, -1, 0, 0) end
local sets = {}
for i = 0, n - 1 do
  local k, a = 1 + i * 5, 7 + i * 5
  local rpm, tpm, maxc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local dayb, monb = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if maxc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now_ms)
    if redis.call('ZCARD', KEYS[k + 3]) >= maxc then return answer(0, 3, i, 0, 0) end
  end
  local day = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
  if dayb >= 0 and (day >= dayb or day + cost > dayb) then return answer(0, 4, i, 0, day) end
  local month = tonumber(redis.call('GET', KEYS[k + 5]) or '0')
  if monb >= 0 and (month >= monb or month + cost > monb) then return answer(0, 5, i, 0, month) end
  for q, spec in ipairs({{rpm, 1, 1}, {tpm, tokens, 2}}) do
    local limit, units, kind = spec[1], spec[2], spec[3]
    if limit > 0 then
      local tat = tonumber(redis.call('GET', KEYS[k + q]) or '0')
      local new = math.max(tat, now) + units * interval(limit)
      if new - now > W then
        if kind == 1 then rq = tighter(rq, window(limit, tat)) else tk = tighter(tk, window(limit, tat)) end
        return answer(0, kind, i, new - now - W, 0)
      end
      if kind == 1 then rq = tighter(rq, window(limit, new)) else tk = tighter(tk, window(limit, new)) end
      table.insert(sets, {KEYS[k + q], new})
    end
  end
end
for _, s in ipairs(sets) do
  redis.call('SET', s[1], string.format('%d', s[2]), 'PX', math.floor((s[2] - now) / 1000) + 1000)
end
for i = 0, n - 1 do
  local k, a = 1 + i * 5, 7 + i * 5
  if tonumber(ARGV[a + 3]) > 0 then
    redis.call('ZADD', KEYS[k + 3], now_ms + lease, aid)
    redis.call('PEXPIRE', KEYS[k + 3], 2 * lease)
  end
  if cost > 0 and (tonumber(ARGV[a + 4]) >= 0 or tonumber(ARGV[a + 5]) >= 0) then
    redis.call('INCRBY', KEYS[k + 4], cost)
    redis.call('EXPIRE', KEYS[k + 4], 2 * 86400)
    redis.call('INCRBY', KEYS[k + 5], cost)
    redis.call('EXPIRE', KEYS[k + 5], 32 * 86400)
  end
end
redis.call('SET', KEYS[1], 'admitted', 'PX', keep)
return answer(1, 0, -1, 0, 0)
