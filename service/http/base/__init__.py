"""What every protocol of an HTTP process shares: limits on what a client sends, admission, API
keys, the view of the workers' health, and the observer (request id, access log, counts). The request
pipeline (service/http/pipeline/) calls these in order; nothing here imports it or the protocols."""
