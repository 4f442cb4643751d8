"""The Lua of admission (run by policies/admission.py): reserve, release and renew, each one
atomic script over a tenant's counters, its key's counters and their budgets. Key layout and
semantics are in docs/design/admission-and-ledger.md.

A reservation record (`res` hash, by request id) is
`charged kv cost key_charged tenant_budget key_budget`: the tokens taken from the tenant's
and the key's token buckets, the KV tokens held, the worst-case cost in nano-dollars held
against each budget, and the budgets' period keys (`-` for none).
"""

from __future__ import annotations

PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_us = string.format('%.0f', now)

local function parse_res(r)
  local f = {}
  for w in string.gmatch(r, '%S+') do f[#f + 1] = w end
  return {charged = tonumber(f[1]), kv = tonumber(f[2]), cost = tonumber(f[3] or '0'),
          kcharged = tonumber(f[4] or '0'), tbud = f[5] or '-', kbud = f[6] or '-'}
end

local function add_kv(kv_key, delta)
  if redis.call('INCRBY', kv_key, delta) <= 0 then redis.call('DEL', kv_key) end
end

-- move a reservation's worst-case cost in or out of the budgets it holds
local function hold_budgets(rec, sign)
  if rec.cost == 0 then return end
  for _, bud in ipairs({rec.tbud, rec.kbud}) do
    if bud ~= '-' then
      redis.call('HINCRBY', bud, 'reserved', string.format('%.0f', sign * rec.cost))
    end
  end
end

local LAPSED_KEEP_MS = 86400000

local function purge(lease_key, res_key, kv_key, lapsed)
  local expired = redis.call('ZRANGEBYSCORE', lease_key, '-inf', now_us)
  if #expired == 0 then return end
  local kv = 0
  for _, id in ipairs(expired) do
    local r = redis.call('HGET', res_key, id)
    if r then
      local rec = parse_res(r)
      kv = kv + rec.kv
      hold_budgets(rec, -1)
      redis.call('HDEL', res_key, id)
      redis.call('HSET', lapsed, id, r)
    end
  end
  redis.call('PEXPIRE', lapsed, LAPSED_KEEP_MS)
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now_us)
  add_kv(kv_key, -kv)
end

local function expire_leases(lease_key, res_key, kv_key)
  local last = redis.call('ZRANGE', lease_key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local at_ms = string.format('%.0f', math.floor(tonumber(last[2]) / 1000) + 1000)
  redis.call('PEXPIREAT', lease_key, at_ms)
  redis.call('PEXPIREAT', res_key, at_ms)
  redis.call('PEXPIREAT', kv_key, at_ms)
end

-- tokens in the bucket now (a missing bucket is full)
local function level(key, cap)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap end
  local elapsed = math.max(now - ts, 0)
  return math.min(cap, tokens + elapsed * cap / 60000000)
end

local function store(key, cap, tokens)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens),
             'ts', now_us, 'cap', cap)
  local to_full_ms = (cap - tokens) * 60000 / cap
  redis.call('PEXPIRE', key, string.format('%.0f', math.ceil(to_full_ms) + 1000))
end

local function credit(key, amount)
  local cap = tonumber(redis.call('HGET', key, 'cap'))
  if amount > 0 and cap then store(key, cap, math.min(cap, level(key, cap) + amount)) end
end

local function seconds_to_fill(cap, tokens, target)
  return string.format('%.6f', math.max(target - tokens, 0) * 60 / cap)
end
"""

RESERVE = (
    PRELUDE
    + """
local req_key, tok_key, lease_key, res_key, kv_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lapsed, kreq_key, ktok_key, klease_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local tbud, kbud, used_key = KEYS[10], KEYS[11], KEYS[12]
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_conc, kv_budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local id, cost, kv_tokens = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local lease_us, busy_retry = tonumber(ARGV[8]), ARGV[9]
local krpm, ktpm, kconc = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local key_id = ARGV[13]
local price, tlimit, klimit = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
local texpire, kexpire = ARGV[17], ARGV[18]
local eps = 1e-9

purge(lease_key, res_key, kv_key, lapsed)
redis.call('ZREMRANGEBYSCORE', klease_key, '-inf', now_us)
local req = rpm and level(req_key, rpm)
local tok = tpm and level(tok_key, tpm)
local kreq = krpm and level(kreq_key, krpm)
local ktok = ktpm and level(ktok_key, ktpm)

local function verdict(ok, reason, retry, hard, left)
  local out = {ok, reason, retry, hard, false, false, false, false, left or false}
  if rpm then out[5], out[6] = math.floor(req + eps), seconds_to_fill(rpm, req, rpm) end
  if tpm then out[7], out[8] = math.floor(tok + eps), seconds_to_fill(tpm, tok, tpm) end
  return out
end

local function left_in(bud, limit)
  local v = redis.call('HMGET', bud, 'spent', 'reserved')
  return limit - (tonumber(v[1]) or 0) - (tonumber(v[2]) or 0)
end

if redis.call('ZSCORE', lease_key, id) then return verdict(1, '', '', 0) end
if tpm and cost > tpm then return verdict(0, 'tpm', '', 1) end
if ktpm and cost > ktpm then return verdict(0, 'key_tpm', '', 1) end
if kv_budget and kv_tokens > kv_budget then return verdict(0, 'kv_budget', '', 1) end
if tlimit then
  local left = left_in(tbud, tlimit)
  if price > left then
    return verdict(0, 'tenant_budget', '', 1, string.format('%.0f', math.max(left, 0)))
  end
end
if klimit then
  local left = left_in(kbud, klimit)
  if price > left then
    return verdict(0, 'key_budget', '', 1, string.format('%.0f', math.max(left, 0)))
  end
end
if rpm and req + eps < 1 then
  return verdict(0, 'rpm', seconds_to_fill(rpm, req, 1), 0)
end
if tpm and tok + eps < cost then
  return verdict(0, 'tpm', seconds_to_fill(tpm, tok, cost), 0)
end
if krpm and kreq + eps < 1 then
  return verdict(0, 'key_rpm', seconds_to_fill(krpm, kreq, 1), 0)
end
if ktpm and ktok + eps < cost then
  return verdict(0, 'key_tpm', seconds_to_fill(ktpm, ktok, cost), 0)
end
if max_conc and redis.call('ZCARD', lease_key) >= max_conc then
  return verdict(0, 'concurrency', busy_retry, 0)
end
if kconc and redis.call('ZCARD', klease_key) >= kconc then
  return verdict(0, 'key_concurrency', busy_retry, 0)
end
if kv_budget and (tonumber(redis.call('GET', kv_key)) or 0) + kv_tokens > kv_budget then
  return verdict(0, 'kv_budget', busy_retry, 0)
end

local charged, kcharged = 0, 0
if rpm then req = math.max(req - 1, 0); store(req_key, rpm, req) end
if tpm then tok = math.max(tok - cost, 0); store(tok_key, tpm, tok); charged = cost end
if krpm then kreq = math.max(kreq - 1, 0); store(kreq_key, krpm, kreq) end
if ktpm then ktok = math.max(ktok - cost, 0); store(ktok_key, ktpm, ktok); kcharged = cost end
local deadline = string.format('%.0f', now + lease_us)
redis.call('ZADD', lease_key, deadline, id)
if kconc then
  redis.call('ZADD', klease_key, deadline, id)
  redis.call('PEXPIRE', klease_key, string.format('%.0f', lease_us / 1000 + 1000))
end
local rec = {charged = charged, kv = kv_tokens, cost = price, kcharged = kcharged,
             tbud = tlimit and tbud or '-', kbud = klimit and kbud or '-'}
hold_budgets(rec, 1)
if tlimit and texpire ~= '' then redis.call('PEXPIREAT', tbud, texpire) end
if klimit and kexpire ~= '' then redis.call('PEXPIREAT', kbud, kexpire) end
redis.call('HSET', res_key, id, string.format('%.0f %.0f %.0f %.0f %s %s', charged, kv_tokens,
           price, kcharged, rec.tbud, rec.kbud))
add_kv(kv_key, kv_tokens)
expire_leases(lease_key, res_key, kv_key)
if key_id ~= '' then redis.call('HSET', used_key, key_id, now_us) end
return verdict(1, '', '', 0)
"""
)

RELEASE = (
    PRELUDE
    + """
local tok_key, lease_key, res_key, kv_key, lapsed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ktok_key, klease_key, events = KEYS[6], KEYS[7], KEYS[8]
local id, used, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tlimit, tmarks, klimit, kmarks = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), ARGV[7]
local tenant_id, key_id = ARGV[8], ARGV[9]
purge(lease_key, res_key, kv_key, lapsed)
local r = redis.call('HGET', res_key, id)
redis.call('ZREM', lease_key, id)
redis.call('ZREM', klease_key, id)
local rec
if r then
  redis.call('HDEL', res_key, id)
  rec = parse_res(r)
  add_kv(kv_key, -rec.kv)
  hold_budgets(rec, -1)
else
  r = redis.call('HGET', lapsed, id)
  if not r then return 0 end
  redis.call('HDEL', lapsed, id)
  rec = parse_res(r)  -- its KV and budget holds were freed when it lapsed
end
credit(tok_key, rec.charged - used)
credit(ktok_key, rec.kcharged - used)

-- the real cost becomes spend; a soft threshold crossed by it is recorded once
local function spend(bud, limit, marks, scope)
  if bud == '-' or actual <= 0 then return end
  local before = tonumber(redis.call('HGET', bud, 'spent')) or 0
  local after = redis.call('HINCRBY', bud, 'spent', string.format('%.0f', actual))
  if not limit or marks == '' then return end
  for pct in string.gmatch(marks, '%d+') do
    local mark = limit * tonumber(pct) / 100
    if before < mark and after >= mark then
      redis.call('XADD', events, 'MAXLEN', '~', 10000, '*',
                 'scope', scope, 'tenant_id', tenant_id, 'key_id', key_id,
                 'period', string.match(bud, ':([^:]+)$'), 'threshold_pct', pct,
                 'limit_nanos', string.format('%.0f', limit),
                 'spent_nanos', string.format('%.0f', after), 'at_us', now_us)
    end
  end
end
spend(rec.tbud, tlimit, tmarks, 'tenant')
spend(rec.kbud, klimit, kmarks, 'key')
return 1
"""
)

RENEW = (
    PRELUDE
    + """
local lease_key, res_key, kv_key, lapsed, klease_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, deadline = ARGV[1], string.format('%.0f', now + tonumber(ARGV[2]))
purge(lease_key, res_key, kv_key, lapsed)
local state = 1
if not redis.call('ZSCORE', lease_key, id) then
  local r = redis.call('HGET', lapsed, id)
  if not r then return 0 end
  redis.call('HDEL', lapsed, id)
  redis.call('HSET', res_key, id, r)
  local rec = parse_res(r)
  add_kv(kv_key, rec.kv)
  hold_budgets(rec, 1)
  redis.call('ZADD', klease_key, deadline, id)
  state = 2
else
  redis.call('ZADD', klease_key, 'XX', deadline, id)
end
redis.call('ZADD', lease_key, deadline, id)
redis.call('PEXPIRE', klease_key, string.format('%.0f', tonumber(ARGV[2]) / 1000 + 1000))
expire_leases(lease_key, res_key, kv_key)
return state
"""
)
