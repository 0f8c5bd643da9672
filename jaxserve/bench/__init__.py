"""``jaxserve bench``: a serving benchmark against any OpenAI-compatible endpoint (like ``vllm bench serve``).

    jaxserve bench --url http://127.0.0.1:8000 [--workload random|shared-prefix|multi-turn]
                   [--num-prompts 200] [--input-len 1024] [--output-len 128] [--range-ratio 0.0]
                   [--request-rate inf] [--max-concurrency C | --concurrency-sweep 1,4,16,32]
                   [--json PATH|-] [--plot PATH.png]

Workloads (``make_workload``, deterministic in ``--seed``):
- ``random``: prompts of random token ids, sent as a ``prompt`` list on /v1/completions (or, with
  ``--prompt-format text``, random words sized with the server's own tokens-per-word, measured by
  two calibration requests before the run).
- ``shared-prefix``: ``--num-groups`` groups; every prompt is its group's prefix (``--prefix-len``
  tokens) followed by its own tail (``--input-len`` tokens); the order is shuffled.
- ``multi-turn``: sessions of ``--turns`` requests sent one after the other; each turn adds a new user
  part of ``--input-len`` tokens to the conversation so far (chat messages, or on /v1/completions
  the previous prompt + its answer + the new part), so the context grows turn by turn.

Load: session starts follow a Poisson process of ``--request-rate`` per second (``inf``: all at once),
and at most ``--max-concurrency`` requests are in flight. Every request streams, greedy, with
``max_tokens`` = its output length and vLLM's ``ignore_eos`` (unless ``--no-ignore-eos``), and
asks for the sampled tokens' logprobs (unless ``--no-logprobs``) so that every token is a chunk
of its own: a server sends no chunk for a token whose text it holds back (part of a multi-byte
character, common with random token ids), and TTFT / ITL would otherwise be the visible text's.

Per request: TTFT (send to the first chunk with a token: content or its logprobs), ITL (between
consecutive such chunks), TPOT ((e2e - ttft) / (output tokens - 1)), e2e latency, output tokens
(``usage`` when the server sends it, else content chunks), prompt and cached tokens (``usage``). A failed request (an
HTTP status, a broken stream, a timeout) is counted with its message; it never stops the run.

Exit code: 0 every request succeeded, 1 some failed (the report says which error), 2 usage errors
or a server that cannot be reached (one line on stderr).

Modules: ``workload`` (what to send, when), ``metrics`` (records and statistics), ``client`` (HTTP),
``run`` (config, load, ``main``), ``report`` (table and plot).
"""

from jaxserve.bench.run import main
from jaxserve.bench.workload import BenchError

__all__ = ["BenchError", "main"]
