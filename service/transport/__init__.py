"""The channels between HTTP processes and inference workers (ZeroMQ over Unix sockets): both ends."""
