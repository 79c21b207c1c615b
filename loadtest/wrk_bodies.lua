-- wrk script of `kvroute bench workers` (loadtest/bench_workers.py): POSTs the JSON bodies of the
-- file named by its first argument (one body per line) to /v1/chat/completions, in turn, on
-- keep-alive connections; at the end prints one JSON line of counts for the benchmark to read.
--   wrk -t1 -c32 -d5s -s loadtest/wrk_bodies.lua http://127.0.0.1:8080 -- bodies.jsonl

local requests = {}
local turn = 0

function init(args)
  for body in io.lines(args[1]) do
    requests[#requests + 1] = wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
  end
  if #requests == 0 then
    error("no request bodies in " .. args[1])
  end
end

function request()
  turn = turn % #requests + 1
  return requests[turn]
end

function done(summary, _, _)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "seconds": %.6f, "status_errors": %d, "socket_errors": %d}\n',
    summary.requests, summary.duration / 1e6, e.status, e.connect + e.read + e.write + e.timeout))
end
