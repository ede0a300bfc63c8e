-- Admit one request against every scope of it, atomically: check all, then
-- take from all. GCRA per limited quantity (the same arithmetic as gcra.rs), a
-- counter of requests in flight, and the spend sums of the day and month.
-- Time is Redis's own (TIME), so every replica reads the same clock.
--
-- KEYS: five per scope: requests TAT, tokens TAT, in flight, day spend, month spend.
-- ARGV: scopes, tokens, window (µs); then five per scope: requests per window,
-- tokens per window, max in flight (0: none), daily and monthly budget in
-- nano-USD (-1: none).
-- Returns {admitted, kind, scope, wait_µs, spent_nano,
--          req_limit, req_remaining, req_reset_µs, tok_limit, tok_remaining, tok_reset_µs}
-- (-1 where there is none); kind 1 requests, 2 tokens, 3 concurrency, 4 day, 5 month.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n, tokens, W = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
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
local sets = {}
for i = 0, n - 1 do
  local k, a = i * 5, 3 + i * 5
  local rpm, tpm, maxc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local dayb, monb = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if maxc > 0 and tonumber(redis.call('GET', KEYS[k + 3]) or '0') >= maxc then
    return answer(0, 3, i, 0, 0)
  end
  local day = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
  if dayb >= 0 and day >= dayb then return answer(0, 4, i, 0, day) end
  local month = tonumber(redis.call('GET', KEYS[k + 5]) or '0')
  if monb >= 0 and month >= monb then return answer(0, 5, i, 0, month) end
  for q, spec in ipairs({{rpm, 1, 1}, {tpm, tokens, 2}}) do
    local limit, cost, kind = spec[1], spec[2], spec[3]
    if limit > 0 then
      local tat = tonumber(redis.call('GET', KEYS[k + q]) or '0')
      local new = math.max(tat, now) + cost * interval(limit)
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
  if tonumber(ARGV[3 + i * 5 + 3]) > 0 then
    redis.call('INCR', KEYS[i * 5 + 3])
    redis.call('PEXPIRE', KEYS[i * 5 + 3], 600000)
  end
end
return answer(1, 0, -1, 0, 0)
