"""The server-side Lua scripts of the Redis index and load view, and how they are called.

Key layout under a namespace ``ns`` (every key carries the hash tag ``{ns}``, see below):

``{ns}:blocks:<backend>``   ZSET  block hash (8 bytes, big-endian) -> eviction score.
                            One per backend: exactly the in-memory index's per-backend
                            BlockSet, trimmed to the backend's capacity by ZPOPMIN, so the
                            belief model's capacity and eviction policy hold in Redis too.
                            Expires ``key_ttl_s`` after the backend's last recorded request.
``{ns}:clock``              STRING  a counter giving every touch a global order across replicas
                            (expires with the last write, like everything else).
``{ns}:epochs``             ZSET  clock value -> server time (ms), per write batch, for the
                            ``ttl`` eviction policy: which touches are older than its ttl.
``{ns}:replicas``           ZSET  router replica id -> last publish time (ms, server clock).
``{ns}:loadparts``          HASH  router replica id -> JSON {backend: [in-flight, pending
                            prefill tokens, pending prefill requests]}: what that replica has
                            added to the sums.
``{ns}:loadsums``           HASH  "n/", "t/", "r/" + backend -> every live replica's counts
                            there, summed; "@built" -> when they were last rebuilt from the parts.

Why no per-block key ("which backends hold block b"): a lookup asks each candidate's ZSET
for the chain's blocks in order and stops, per backend, at its first miss; its cost is
chain length x candidates, never the index's size, and one ZSET per backend means no
orphaned reverse entries to expire, one TTL per backend, and half the memory.

Why one hash tag: a Lua script may only touch keys of one Cluster slot, and a lookup must
read every candidate's ZSET in one round trip. So in Cluster the whole namespace lives on
one master (Cluster then gives failover and shares the cluster the operator already runs,
not sharding of the index). The index is bounded by capacity x backends, so one master
holds it comfortably; a deployment that outgrows that splits by namespace.

Every script declares all keys it touches in KEYS, as Cluster requires.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

#: Shared by MATCH and RECORD: the highest sequence number that is expired under the ttl
#: policy (every block touched at or before it was last used more than ttl_ms ago), from
#: the epochs ZSET (sequence -> server time of the batch that reached it); 0 when none is.
EXPIRED_UP_TO = """
local function expired_up_to(epochs, ttl)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local last = redis.call('ZREVRANGEBYSCORE', epochs, now - ttl, '-inf', 'LIMIT', 0, 1)
  return last[1] and tonumber(last[1]) or 0, now
end
"""

#: KEYS[1]: the epochs ZSET; KEYS[2..]: the candidates' block ZSETs.
#: ARGV: policy, the belief ttl in ms (ttl policy), the chain packed (8 bytes a block).
#: Returns, per candidate, the matched depth and the ZSET's size: {depth1, size1, ...}.
#: With the shared load view riding on the lookup (``index.redis.load_on_lookup``), ARGV[4]
#: is a count F of fields and ARGV[5..4+F] the fields, KEYS[#KEYS] the load sums hash, and
#: the F sums (0 for a missing one) follow the candidates' pairs: one round trip for both.
#:
#: A backend's set always holds a *prefix* of any chain: every write touches a chain from
#: its block 0 and scores block i above block i+1 (see RECORD), and everything that removes
#: entries (capacity, the global budget, the ttl cut) removes the lowest scores first. So
#: "held to depth d" is monotone along the chain, and the depth is found by galloping
#: (blocks 1, 2, 4, 8, ... until a miss) and then bisecting: O(log depth) ZSCOREs per
#: candidate, one for a candidate that misses the first block, instead of one per block.
#: A test replays random traffic through this and the in-memory walk and compares.
MATCH = (
    EXPIRED_UP_TO
    + """
local ttl, cut = ARGV[1] == 'ttl', 0
if ttl then cut = expired_up_to(KEYS[1], tonumber(ARGV[2])) end
local chain = ARGV[3]
local blocks = #chain / 8
local function held(key, b)
  local score = redis.call('ZSCORE', key, string.sub(chain, 8 * b - 7, 8 * b))
  return score and (not ttl or tonumber(score) > cut)
end
local fields = tonumber(ARGV[4] or '0')
local candidates = fields > 0 and #KEYS - 1 or #KEYS
local out = {}
for i = 2, candidates do
  local key = KEYS[i]
  local lo, hi, probe = 0, nil, 1
  while probe <= blocks do
    if held(key, probe) then
      lo, probe = probe, probe * 2
    else
      hi = probe
      break
    end
  end
  if hi == nil and lo < blocks then
    if held(key, blocks) then lo = blocks else hi = blocks end
  end
  if hi ~= nil then
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if held(key, mid) then lo = mid else hi = mid end
    end
  end
  out[#out + 1] = lo
  out[#out + 1] = redis.call('ZCARD', key)
end
if fields > 0 then
  local sums = redis.call('HMGET', KEYS[#KEYS], unpack(ARGV, 5, 4 + fields))
  for k = 1, fields do out[#out + 1] = sums[k] or 0 end
end
return out
"""
)

#: KEYS[1]: the clock; KEYS[2]: the epochs ZSET; KEYS[3..]: the block ZSETs of every backend
#: this router knows. ARGV: policy, key ttl in ms, belief ttl in ms, max_blocks, then
#: records, each as (index into KEYS, capacity, the chain packed 8 bytes a block).
#: Returns the number of entries evicted (capacity, belief ttl and global budget). A record
#: with an empty chain only trims its set to the capacity (an engine reported a smaller cache).
#:
#: Scores mirror the in-memory BlockSets. A global sequence (the clock) orders every touch
#: across replicas; a chain's block 0 gets the highest number, so a chain's first blocks
#: (shared by every longer prompt) are evicted last. lru and ttl score by sequence; ttl
#: also drops blocks last touched more than the belief ttl ago; lfu scores
#: count * 2^40 + sequence mod 2^40, so the least used go first and, among equals, the least
#: recently used (counts saturate at 8191 to stay exact in a double). A record is one
#: ZADD of all its blocks (one ZMSCORE before it for lfu), in runs that fit Lua's stack.
RECORD = (
    EXPIRED_UP_TO
    + """
local policy, key_ttl = ARGV[1], tonumber(ARGV[2])
local belief_ttl, max_blocks = tonumber(ARGV[3]), tonumber(ARGV[4])
local RECENCY, RUN = 1099511627776, 2000
local pos, evicted = 5, 0
while pos <= #ARGV do
  local key, capacity, chain = KEYS[tonumber(ARGV[pos])], tonumber(ARGV[pos + 1]), ARGV[pos + 2]
  pos = pos + 3
  local n = #chain / 8
  local top = redis.call('INCRBY', KEYS[1], n)
  for first = 0, n - 1, RUN do
    local last = math.min(first + RUN, n) - 1
    local members = {}
    for i = first, last do members[#members + 1] = string.sub(chain, 8 * i + 1, 8 * i + 8) end
    local old = {}
    if policy == 'lfu' then old = redis.call('ZMSCORE', key, unpack(members)) end
    local pairs = {}
    for j, member in ipairs(members) do
      local seq = top - (first + j - 1)
      local score = seq
      if policy == 'lfu' then
        local count = old[j] and math.floor(tonumber(old[j]) / RECENCY) or 0
        score = math.min(count + 1, 8191) * RECENCY + seq % RECENCY
      end
      pairs[#pairs + 1] = score
      pairs[#pairs + 1] = member
    end
    redis.call('ZADD', key, unpack(pairs))
  end
  local over = redis.call('ZCARD', key) - capacity
  if over > 0 then
    redis.call('ZPOPMIN', key, over)
    evicted = evicted + over
  end
  redis.call('PEXPIRE', key, key_ttl)
end
redis.call('PEXPIRE', KEYS[1], key_ttl)
if policy == 'ttl' then
  local cut, now = expired_up_to(KEYS[2], belief_ttl)
  redis.call('ZADD', KEYS[2], now, redis.call('GET', KEYS[1]))
  if cut > 0 then
    for i = 3, #KEYS do evicted = evicted + redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', cut) end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - belief_ttl))
  end
  redis.call('PEXPIRE', KEYS[2], key_ttl)
end
-- The global budget: take from the largest backend until the whole index fits.
local sizes, total = {}, 0
for i = 3, #KEYS do
  sizes[i] = redis.call('ZCARD', KEYS[i])
  total = total + sizes[i]
end
while total > max_blocks do
  local largest = 3
  for i = 4, #KEYS do if sizes[i] > sizes[largest] then largest = i end end
  local excess = math.min(total - max_blocks, sizes[largest])
  redis.call('ZPOPMIN', KEYS[largest], excess)
  sizes[largest] = sizes[largest] - excess
  total = total - excess
  evicted = evicted + excess
end
return evicted
"""
)

#: The shared load view's keys: KEYS[1] the replicas ZSET (id -> last publish, ms); KEYS[2] the
#: contributions HASH (id -> JSON {backend: [in-flight, tokens, requests]}: what each live
#: replica has added to the sums); KEYS[3] the sums HASH (``n/``, ``t/``, ``r/`` + backend:
#: every live replica's in-flight, pending tokens and requests, summed; ``@built``: when it
#: was last rebuilt from the contributions).
#:
#: A call updates the sums by what changed (its own counts, and the contributions of replicas
#: silent for ttl_ms, withdrawn) and reads them for its own backends, so its cost grows with
#: the backends alone, where a scan of every replica's fields grew with replicas x backends
#: and the fleet's calls with the square of the replicas (``python -m loadtest.bench_shared_load``).
#: Once a minute, or when a sum went negative (a key lost to eviction or a flush), the sums
#: are rebuilt from the live replicas' contributions, so no drift outlives a minute.
_LOAD_VIEW = """
local REBUILD_MS = 60000
local rebuild = false
local function bump(field, value)
  if value ~= 0 and redis.call('HINCRBY', KEYS[3], field, value) < 0 then rebuild = true end
end
local function add(backend, n, t, r)
  bump('n/' .. backend, n)
  bump('t/' .. backend, t)
  bump('r/' .. backend, r)
end
local function contribution(replica)
  local raw = redis.call('HGET', KEYS[2], replica)
  return raw and cjson.decode(raw) or {}
end
local function withdraw(replica)
  for backend, c in pairs(contribution(replica)) do add(backend, -c[1], -c[2], -c[3]) end
  redis.call('HDEL', KEYS[2], replica)
  redis.call('ZREM', KEYS[1], replica)
end
local function rebuild_sums(now)
  redis.call('DEL', KEYS[3])
  local live = {}
  for _, replica in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do live[replica] = true end
  local entries = redis.call('HGETALL', KEYS[2])
  for i = 1, #entries, 2 do
    if live[entries[i]] then
      for backend, c in pairs(cjson.decode(entries[i + 1])) do add(backend, c[1], c[2], c[3]) end
    else
      redis.call('HDEL', KEYS[2], entries[i])
    end
  end
  redis.call('HSET', KEYS[3], '@built', now)
end
"""

#: ARGV: replica id, ttl_ms, then (backend, in-flight, pending prefill tokens, pending prefill
#: requests) of this replica. Publishes them (a backend it no longer lists is withdrawn) and
#: returns the number of live replicas, then the other live replicas' sums for its backends:
#: {replicas, backend1, in-flight1, tokens1, requests1, ...}.
LOAD = (
    _LOAD_VIEW
    + """
local id, ttl = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)) do
  if replica ~= id then withdraw(replica) end
end
redis.call('ZADD', KEYS[1], now, id)
local before, mine, listed, changed = contribution(id), {}, {}, false
for i = 3, #ARGV, 4 do
  local backend = ARGV[i]
  local c = {tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])}
  local old = before[backend]
  if not old or c[1] ~= old[1] or c[2] ~= old[2] or c[3] ~= old[3] then
    old = old or {0, 0, 0}
    add(backend, c[1] - old[1], c[2] - old[2], c[3] - old[3])
    changed = true
  end
  mine[backend] = c
  listed[#listed + 1] = backend
end
for backend, old in pairs(before) do
  if not mine[backend] then
    add(backend, -old[1], -old[2], -old[3])
    changed = true
  end
end
if changed or #listed == 0 then
  redis.call('HSET', KEYS[2], id, #listed > 0 and cjson.encode(mine) or '{}')
end
local built = tonumber(redis.call('HGET', KEYS[3], '@built') or '0')
if rebuild or now - built > REBUILD_MS then rebuild_sums(now) end
for k = 1, 3 do redis.call('PEXPIRE', KEYS[k], ttl) end
local out = {redis.call('ZCARD', KEYS[1])}
if #listed == 0 then return out end
local fields = {}
for _, backend in ipairs(listed) do
  fields[#fields + 1] = 'n/' .. backend
  fields[#fields + 1] = 't/' .. backend
  fields[#fields + 1] = 'r/' .. backend
end
local sums = redis.call('HMGET', KEYS[3], unpack(fields))
for k, backend in ipairs(listed) do
  out[#out + 1] = backend
  for slot = 1, 3 do
    out[#out + 1] = math.max(0, (tonumber(sums[3 * (k - 1) + slot]) or 0) - mine[backend][slot])
  end
end
return out
"""
)

#: ARGV: replica id. A replica that stops cleanly withdraws its counts at once instead of
#: after the TTL.
LEAVE = (
    _LOAD_VIEW
    + """
withdraw(ARGV[1])
return 0
"""
)


class Script:
    """A Lua script called by its SHA1 (EVALSHA), loaded on first use or after a server restart.

    redis-py's own Script helper loads through SCRIPT LOAD on one node; calling EVAL when
    the SHA is unknown loads it on whichever node the keys route to, Cluster included.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Add this call to ``pipe`` (a pipeline executed with ``raise_on_error=False``), by SHA1."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def settle(self, client: Any, reply: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """This call's reply from the pipeline; the call again alone, loading the script, if the
        server did not have it (a restart), and the error raised if it failed."""
        if isinstance(reply, NoScriptError):
            return await self(client, keys, args)
        if isinstance(reply, Exception):
            raise reply
        return reply


@dataclass(frozen=True)
class LoadCall:
    """One call of the LOAD script publishing a replica's counts (``own``, per backend)."""

    script: Script
    keys: list[str]
    args: list[object]
    own: dict[str, tuple[int, int, int]]


@dataclass(frozen=True)
class SumsRead:
    """A lookup's read of the load sums: the hash, its fields, and the count of the reader's
    own publishes when it was sent (the reply is of use only if none started since)."""

    key: str
    fields: list[str]
    publishes: int


class Keys:
    """Key names under one namespace, all in the hash tag ``{namespace}`` (one Cluster slot)."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"{{{namespace}}}:"
        self.clock = self.prefix + "clock"
        self.epochs = self.prefix + "epochs"
        self.replicas = self.prefix + "replicas"
        #: The shared load view: each replica's counts, and their running sums (_LOAD_VIEW).
        self.load_parts = self.prefix + "loadparts"
        self.load_sums = self.prefix + "loadsums"
        #: ``lookup: local``'s stream of belief batches (router.index.redis_sync).
        self.beliefs = self.prefix + "beliefs"

    def blocks(self, backend: str) -> str:
        return f"{self.prefix}blocks:{backend}"


def pack_chain(chain: Sequence[int]) -> bytes:
    """A chain as one argument: 8 big-endian bytes a block, each a ZSET member as it is.

    One packed string instead of an argument per block keeps encoding the call cheap for the
    router (one C call) and binary members take half the memory of hex ones.
    """
    return struct.pack(f">{len(chain)}Q", *chain)
