"""The model repository: its folders and per-model configs, the routing table the main process
publishes to the HTTP processes, and the control messages of Triton's repository extension."""
