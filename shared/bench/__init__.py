"""`pdserve bench`: the serving benchmark against any OpenAI-compatible server.

datasets (token-id workloads) -> arrivals (when each request is sent) -> client (streaming
requests, one RequestRecord each) -> metrics (vLLM-compatible definitions, goodput) -> report
(JSON, markdown, plots). cli is the command. The scenario harness that starts pinned pdserve
topologies and compares them side by side stays in perf/bench (perf is never installed).
"""
