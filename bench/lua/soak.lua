-- wrk script for bench/soak.py: cycles through prepared requests, counts the answers by
-- status, and prints one line of JSON when done.
-- Usage: wrk -s bench/lua/soak.lua URL -- REQUESTS_FILE   (one "path<TAB>json body" per line)

local prepared = {}
local counter = 0
statuses = {}

function init(args)
  for line in io.lines(args[1]) do
    local path, body = line:match("^(%S+)\t(.*)$")
    prepared[#prepared + 1] = wrk.format(
      "POST", path, {["Content-Type"] = "application/json"}, body
    )
  end
  -- Threads and runs start at different places in the cycle.
  math.randomseed(os.time() + tonumber(tostring(prepared):match("0x(%x+)") or "0", 16))
  counter = math.random(#prepared)
end

function request()
  counter = counter % #prepared + 1
  return prepared[counter]
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

local threads = {}

function setup(thread)
  threads[#threads + 1] = thread
end

function done(summary, latency, requests)
  local totals = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses")) do
      totals[status] = (totals[status] or 0) + count
    end
  end
  local counts = {}
  for status, count in pairs(totals) do
    counts[#counts + 1] = string.format('"%d": %d', status, count)
  end
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, "statuses": {%s}, ' ..
    '"socket_errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"non_2xx": %d, "latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}}\n',
    summary.requests, summary.duration, summary.bytes, table.concat(counts, ", "),
    errors.connect, errors.read, errors.write, errors.timeout, errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean
  ))
end
