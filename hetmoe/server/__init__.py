"""``hetmoe serve``: an OpenAI-compatible HTTP server.

``app.py`` (aiohttp routes, API key, streaming) -> ``protocol.py`` (request validation, OpenAI response shapes)
-> ``bridge.py`` (the engine thread: it runs engine/scheduler.py, the continuous batching loop LLM runs too, and
hands each request's events back to asyncio) -> the Runner. ``metrics.py``: the Prometheus text of
``GET /metrics``. ``main.py``: loading, binding, signals.
"""
