"""``hetmoe serve``: an OpenAI- and Anthropic-compatible HTTP server.

``app.py`` (aiohttp routes, the checks before a request is queued, streaming) -> ``protocol.py`` (request
validation, OpenAI response shapes; ``chat.py`` the chat requests' tools, reasoning and structured output, with
``tool_calls/`` (one parser per model family) and ``reasoning.py``; ``anthropic.py`` translates the Messages API
onto it, ``logprobs.py`` writes log-probabilities, ``tokens.py`` answers /tokenize and /detokenize) ->
``bridge.py`` (the engine thread: it runs engine/scheduler.py, the continuous batching loop LLM runs too, and hands
each request's events back to asyncio) -> the Runner. Before a request reaches validation: ``access.py`` (API key,
Host header), ``limits.py`` (body size, JSON shape, the limits' defaults), ``connections.py`` (connection cap,
header and keep-alive deadlines, accept errors in the log), ``cors.py`` (cross-origin requests).
``access_log.py``: a line per request. ``metrics.py``: the Prometheus text of ``GET /metrics``. ``main.py``:
loading, binding, signals.
"""
