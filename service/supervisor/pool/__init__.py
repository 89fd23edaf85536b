"""The main process's model pool: which inference workers serve which model version, and the
repository calls that change it. ``workers`` (the worker processes), ``restarts`` (a dead serving
worker restarted), ``table_publisher`` (the routing table the HTTP processes follow) and
``repository_operations`` (load, unload, index, using the others)."""
