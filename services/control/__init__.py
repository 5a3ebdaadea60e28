"""The commands that run and steer a deployment, apart from the workers' runtime.

Each is a process of its own (or a short-lived tool) that starts, watches or measures workers
from outside; no worker imports anything here (tests/unit/test_layering.py).

- ``pdserve up``: launcher.py (processes.py spawns NATS, workers and the gateway; launch_checks.py
  refuses bad combinations before anything starts; channel.py is its NATS control subject).
- ``--autoscale``: autoscale.py with autoscale_window.py (what a metrics window saw), placement.py
  (which CPUs or GPU a new worker gets) and warm_pool.py (standby workers promoted instead of cold
  starts; the workers' own side is services/standby.py).
- ``pdserve rollout``: rollout_command.py asks a running ``up`` over channel.py; rollout.py
  replaces the workers, version_probe.py checks the new ones before clients reach them.
- ``pdserve plan``: planner/ (profile this model here, size prefill and decode workers).
- ``pdserve bench``: bench/ (the serving benchmark against any OpenAI-compatible server).
- ``pdserve doctor``: doctor/ (the KV path: UCX transports, pull bandwidth, a running stack).
- ``pdserve trace``: trace_cli.py (one request's phases from Jaeger).
"""
