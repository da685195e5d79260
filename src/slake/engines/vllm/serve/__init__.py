"""The load benchmark through vLLM's OpenAI-compatible server: ``slake bench --engine vllm --serve``.

One module per job, so that the pure parts are tested without vLLM:

* :mod:`.server` - start ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``) as a subprocess on
  127.0.0.1 with a fixed KV memory, wait for ``/health``, stop it (always), the process tree's RSS;
* :mod:`.client` - the load client (the ``openai`` package): streaming completion requests of token-id prompts
  with at most C in flight, time to first token and per-request latency;
* :mod:`.metrics` - the server's ``/metrics`` (Prometheus text): parsing, and a watcher that samples it while a
  level runs (requests running and waiting, KV cache usage, preemptions);
* :mod:`.report` - percentiles, one row per (configuration, concurrency), the markdown table and the
  throughput-vs-concurrency plot;
* :mod:`.run` - the sweep: per configuration a server, per concurrency a level, rows appended to the JSONL file.
"""
