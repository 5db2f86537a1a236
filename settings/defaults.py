"""The numbers and names that more than one process or command shares, each defined once here: where a server
listens and a client connects, the server's limits that clients assume until it says otherwise, and the engine's
fixed choices that the coordinator checks and a worker acts on. Plain values, no imports: every layer may read them.
"""

from __future__ import annotations

HOST = "127.0.0.1"  # every listener's default interface: loopback, where no key is needed (settings/loopback.py)
ZMQ_PORT = 8765  # launch.py --port; python -m client and python -m openai_server connect here by default
ZMQ_ADDRESS = f"tcp://{HOST}:{ZMQ_PORT}"
HTTP_PORT = 8000  # python -m openai_server --port (launch.py serves HTTP only when given --http-port)

MAX_PENDING_REQUESTS = 4096  # the server refuses (Overloaded) past this many requests queued or running
MAX_MESSAGE_BYTES = 8 << 20  # a client frame larger than this is refused; clients assume it until Info says
# A server's tokens in a step while sequences decode (EngineConfig.max_prefill_beside_decodes; the offline LLM
# keeps 0, throughput first): a few hundred rows cost a decode step little (its weights are read anyway)
SERVER_PREFILL_BESIDE_DECODES = 256
LOG_STATS_INTERVAL_S = 10.0  # seconds between the HTTP front-end's throughput log lines

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")  # kernels/backends.py get_backend
# engine-argument dtype spellings -> torch's name (model/config.py parse_dtype)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPES = ("auto", "bfloat16", "float16", "float32", *DTYPE_ALIASES)
