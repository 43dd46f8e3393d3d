"""``hetmoe serve``: an OpenAI-compatible HTTP server.

``app.py`` (aiohttp routes, API key, streaming) -> ``protocol.py`` (request validation, OpenAI response shapes)
-> ``scheduler.py`` (the engine loop on its own thread: continuous batching over the runner's KV-cache slots)
-> the Runner. ``metrics.py``: the Prometheus text of ``GET /metrics``. ``main.py``: loading, binding, signals.
"""
