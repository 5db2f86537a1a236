"""Errors that cross process boundaries (their names travel in error replies)."""


class RequestError(ValueError):
    """A bad request; the message names the offending field."""


class EngineDeadError(RuntimeError):
    """The workers are gone (killed, crashed, hung); in-flight requests cannot complete."""


class OverloadedError(RuntimeError):
    """The server's queue is full; try again later."""


class AbortedError(RuntimeError):
    """The server is shutting down: it ended the request (still running past its drain), or took no new one."""


class MessageTooLargeError(RequestError):
    """A request whose encoded message is over the server's ``--max-message-bytes``; the client refuses it before
    sending, since ZMQ would drop it and disconnect the client's socket (failing its other requests too)."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit
