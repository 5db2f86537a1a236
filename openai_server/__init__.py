"""An OpenAI-compatible HTTP front-end (FastAPI + uvicorn) for a running coordinator.

It runs in its own process (``python launch.py --http-port PORT`` starts it) and reaches the coordinator only
through the public ZMQ client (client.AsyncClient), so the step loop never waits on HTTP. See docs/OPENAI_API.md.
"""

import signal

# launch.py stops its front-end with this signal: SIGINT and SIGTERM reach the whole process group (a terminal's
# Ctrl-C, systemd's stop), and the parent must end the requests in flight with "abort" before the front-end goes
STOP_SIGNAL = signal.SIGUSR1
