-- wrk script: POST the bodies of a file (one JSON body per line) in turn, and check every
-- answer: status 200, the number of vectors, and the dimension of the first and the last.
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

-- How often `needle` occurs in `text` between positions `first` and `last`, and where it
-- last does. Plain finds, not a pattern's gsub, which copies the body and tries the pattern at
-- every byte: long enough on a large answer to make wrk the bottleneck of its own connections.
local function occurrences(text, needle, first, last)
  local count, at, last_found = 0, first, nil
  while true do
    local found = text:find(needle, at, true)
    if found == nil or found > last then
      return count, last_found
    end
    count, at, last_found = count + 1, found + #needle, found
  end
end

-- The server's JSON has no whitespace (orjson): [[a,b,...],...,[y,z,...]]. The first and the
-- last vector must each hold `dimension` numbers.
local function wrong(body)
  local length = #body
  local first_end = body:find("]", 3, true)
  if body:sub(1, 2) ~= "[[" or body:sub(-2) ~= "]]" or first_end == nil or first_end == 3 then
    return true
  end
  local separators, last_separator = occurrences(body, "],[", 1, length)
  local last_start = last_separator and last_separator + 3 or 3
  return separators + 1 ~= vectors
    or body:sub(last_start, last_start) == "]"
    or occurrences(body, ",", 3, first_end) + 1 ~= dimension
    or occurrences(body, ",", last_start, length) + 1 ~= dimension
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
