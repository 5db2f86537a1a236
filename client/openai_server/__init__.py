"""An OpenAI-compatible HTTP front-end (FastAPI + uvicorn) for a running coordinator.

It runs in its own process (``python launch.py --http-port PORT`` starts it) and reaches the coordinator only
through the public ZMQ client (client.AsyncClient), so the step loop never waits on HTTP. See docs/SERVING.md.
"""
