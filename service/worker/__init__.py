"""Each inference worker process: the batching loop, the classifier it runs (preprocessing, engine,
top-k) and the engine behind it."""
