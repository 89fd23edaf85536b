"""vision-serve: a tree per process. The main process (supervisor/) starts the inference workers
(worker/) and the HTTP processes (http/); they share the transport (transport/), the model
repository's files and routing table (repository/) and the modules at this level (settings,
defaults, errors, wire messages, metrics, logs, the LitServe and uvicorn bridges). The client
(client/) and vision-tune (tune/) run in processes of their own and import nothing of the server's
request path. See docs/development.md for the tree."""
