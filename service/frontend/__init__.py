"""Each HTTP process's plumbing: admission, the dispatcher that sends images to the workers and waits
for their answers, the view of the workers' health, API keys, the access log and request counts."""
