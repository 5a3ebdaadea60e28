"""The SLA planner: how many prefill and decode workers a workload needs.

``pdserve plan`` profiles this model on this hardware with short real runs of a prefill and a
decode engine (profile_run.py drives them, measure.py is one role's run in its own process,
command.py is the command), then hands the measured ``Profile`` to the pure core below.
The autoscaler (../autoscale.py) runs the same core live.

The pure core:

profile (what one worker of each role does on this hardware, as measured points) -> workload (the
request stream and the SLOs) -> sizing (the closed-form arithmetic) -> forecast and demand (Holt
filters of each window's rate and lengths, looked ahead to when a worker asked for now would
serve) -> decide (one pure decision per metrics window: serving and warm-pool targets, with the
guards against the known autoscaler bugs in guards, role_plan and corrections, named in rules)
-> simulate (an engine driven by the profile, no model, with a warm pool, for fast tests and for
a GPU host's scale) -> advisor (the offline P:D advice of ``pdserve plan``). The core's modules use no torch, no processes and no
HTTP: whoever runs workers calls in here.
"""
