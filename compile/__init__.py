"""Model catalog, weights, and (later) the compile stage that turns a model into a served artifact."""
