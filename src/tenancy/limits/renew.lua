-- Renew a live request's concurrency leases (and keep its record): each
-- lease's expiry moves to now + lease. A lease already pruned (the request
-- stopped renewing for longer than a lease) is not brought back.
-- KEYS: the admission record, then the leases of each scope holding one.
-- ARGV: lease (ms), record TTL (ms), admission id.
-- Returns 1 while the admission is live, 0 once it is settled or released.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, keep, aid = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
if redis.call('GET', KEYS[1]) ~= 'admitted' then return 0 end
redis.call('PEXPIRE', KEYS[1], keep)
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now_ms + lease, aid)
  redis.call('PEXPIRE', KEYS[i], 2 * lease)
end
return 1
