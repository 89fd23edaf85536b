"""What to serve and how, decided before any worker starts: the plan types (``plans``), the planner
that makes them in a child process with torch (``planner``, ``memory``; ``python -m
service.supervisor.planning``), the main process's end of that child (``launch``), and the layout
every version must share (``layout``)."""
