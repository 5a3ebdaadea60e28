"""The SLA planner's pure core: how many prefill and decode workers a workload needs.

profile (what one worker of each role does on this hardware, as measured points) -> workload (the
request stream and the SLOs) -> sizing (the closed-form arithmetic) -> decide (one pure decision
per metrics window, with the guards against the known autoscaler bugs) -> simulate (an engine
driven by the profile, no model, for fast tests and for a GPU host's scale) -> advisor (the
offline P:D advice of ``pdserve plan``). No torch, no processes, no HTTP: whoever runs workers
calls in here.
"""
