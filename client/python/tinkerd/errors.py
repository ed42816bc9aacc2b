"""The one exception type of the client: a gRPC status code and the server's message."""

import grpc


class TinkerdError(Exception):
    """A call failed for good: after its retries, or at once for a code that is not retried.

    `code` is the grpc.StatusCode the server (or the channel) answered; `message` is its text,
    which names the offending field for INVALID_ARGUMENT.
    """

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def from_rpc(error: grpc.RpcError) -> TinkerdError:
    return TinkerdError(error.code(), error.details() or "")
