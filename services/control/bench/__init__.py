"""`pdserve bench`: the serving benchmark against any OpenAI-compatible server.

datasets (token-id workloads) -> arrivals (when each request is sent) -> client (streaming
requests, one RequestRecord each) -> metrics (vLLM-compatible definitions, goodput) -> results
(RunResult, JSON and JSONL) -> report (markdown, plots). cli is the command (its options and
`run`); sweep, the work of one invocation (warm-up, one measured run per rate, the summary). The
scenario harness that starts pinned pdserve topologies and compares them side by side stays in
perf/bench (perf is never installed).
"""
