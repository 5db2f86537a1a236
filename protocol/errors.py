"""Errors that cross process boundaries (their names travel in error replies)."""


class RequestError(ValueError):
    """A bad request; the message names the offending field."""


class EngineDeadError(RuntimeError):
    """The workers are gone (killed, crashed, hung); in-flight requests cannot complete."""


class OverloadedError(RuntimeError):
    """The server's queue is full; try again later."""
