"""The main process: resolve what to serve, start the inference workers and the HTTP processes,
restart workers that die, stop everything in order on SIGTERM/SIGINT."""
