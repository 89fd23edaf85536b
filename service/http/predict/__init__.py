"""vision-serve's own HTTP API, in each HTTP process: ``POST /predict`` (parsing, checks, rendering
the answers as JSON) and the upload page."""
