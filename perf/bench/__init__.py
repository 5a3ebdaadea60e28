"""`pdserve bench` and the scenario harness.

datasets (token-id workloads) -> arrivals (when each request is sent) -> client (streaming
requests, one RequestRecord each) -> metrics (vLLM-compatible definitions, goodput) -> report
(JSON, markdown, plots). topology starts pinned pdserve processes and reads their counters;
compare turns side-by-side runs into verdicts against targets.
"""
