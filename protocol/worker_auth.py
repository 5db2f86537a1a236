"""Worker authentication: HMAC-SHA256 proofs that each side of the coordinator-worker socket holds the shared
worker secret, bound to both sides' fresh nonces, the rank and the world size (a proof replayed from another
connection, rank or direction does not verify)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _proof(secret: str, role: bytes, worker_nonce: bytes, coordinator_nonce: bytes, rank: int, world: int) -> bytes:
    # length-prefixed parts: no two different tuples of fields give the same message
    parts = [role, worker_nonce, coordinator_nonce, str(rank).encode(), str(world).encode()]
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def coordinator_proof(secret: str, worker_nonce: bytes, coordinator_nonce: bytes, rank: int, world: int) -> bytes:
    return _proof(secret, b"nanoserve coordinator", worker_nonce, coordinator_nonce, rank, world)


def worker_proof(secret: str, worker_nonce: bytes, coordinator_nonce: bytes, rank: int, world: int) -> bytes:
    return _proof(secret, b"nanoserve worker", worker_nonce, coordinator_nonce, rank, world)


def matches(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison: the time taken tells an impostor nothing about how close it came."""
    return hmac.compare_digest(expected, got)
