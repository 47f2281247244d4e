-- wrk script: POST the bodies of a file (one JSON body per line) in turn, and check every
-- answer: status 200, the number of vectors, and the dimension of the first.
-- Usage: wrk ... -s embed.lua URL -- BODIES_FILE PATH VECTORS DIMENSION
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  bodies = {}
  for line in io.lines(args[1]) do
    bodies[#bodies + 1] = line
  end
  path, vectors, dimension = args[2], tonumber(args[3]), tonumber(args[4])
  next_body, bad, first_bad = 0, 0, ""
  headers = { ["Content-Type"] = "application/json" }
end

function request()
  next_body = next_body % #bodies + 1
  return wrk.format("POST", path, headers, bodies[next_body])
end

-- How often `needle` occurs in `text` up to position `stop` (the end if nil). Plain finds,
-- not a pattern's gsub: that copies the body and tries the pattern at every byte, about 2.6 ms
-- for 32 vectors of 384, long enough to make wrk the bottleneck of its own connections.
local function occurrences(text, needle, stop)
  local count, at = 0, 1
  while true do
    local found = text:find(needle, at, true)
    if found == nil or (stop ~= nil and found > stop) then
      return count
    end
    count, at = count + 1, found + #needle
  end
end

local function wrong(body)
  local first_end = body:find("]", 3, true)
  if body:sub(1, 2) ~= "[[" or body:sub(-2) ~= "]]" or first_end == nil then
    return true
  end
  return occurrences(body, "],[") + 1 ~= vectors
    or occurrences(body, ",", first_end) + 1 ~= dimension
end

function response(status, _, body)
  if status ~= 200 or wrong(body) then
    bad = bad + 1
    if first_bad == "" then
      first_bad = status .. " " .. body:sub(1, 200)
    end
  end
end

function done(summary, latency, _)
  local bad_total, first = 0, ""
  for _, thread in ipairs(threads) do
    bad_total = bad_total + thread:get("bad")
    if first == "" then
      first = thread:get("first_bad")
    end
  end
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "seconds": %.3f, "bad": %d, "socket_errors": %d, '
      .. '"p50_ms": %.3f, "p99_ms": %.3f, "first_bad": %q}\n',
    summary.requests, summary.duration / 1e6, bad_total,
    errors.connect + errors.read + errors.write + errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, (first:gsub("\n", " "))
  ))
end
