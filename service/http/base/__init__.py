"""What every protocol of an HTTP process shares: limits on what a client sends, admission, API
keys, the dispatcher that sends images to the workers and waits for their answers, the view of the
workers' health, and the observer (request id, access log, counts). Imports nothing of the protocols."""
