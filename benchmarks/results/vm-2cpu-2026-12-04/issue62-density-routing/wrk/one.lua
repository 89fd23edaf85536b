local f = io.open("/tmp/exp/coffee.jpg", "rb"); local body = f:read("*all"); f:close()
wrk.method = "POST"; wrk.body = body; wrk.headers["Content-Type"] = "image/jpeg"
request = function() return wrk.format(nil, "/predict?model=m001") end
