local counter = 0
local f = io.open("/tmp/exp/coffee.jpg", "rb"); local body = f:read("*all"); f:close()
wrk.method = "POST"; wrk.body = body; wrk.headers["Content-Type"] = "image/jpeg"
request = function()
  counter = counter + 1
  local n = NMODELS or 20
  return wrk.format(nil, string.format("/predict?model=m%03d", (counter % n) + 1))
end
