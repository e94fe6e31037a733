"""The front door's error types, each with its HTTP status and gRPC code.

One hierarchy serves both doors, so a bad field, a missing key or a rejection reads the same
over HTTP (OpenAI's error JSON) and gRPC (status code + details).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import grpc


@dataclass
class ApiError(Exception):
    """An error the client caused or must handle; never a server bug."""

    message: str
    param: str | None = None
    """The request field at fault (OpenAI's `param`)."""
    retry_after_s: float | None = None
    """When the client may try again (Retry-After; gRPC's retry-after-ms), if the server
    can tell."""

    status = 500
    code = grpc.StatusCode.INTERNAL
    type = "server_error"

    def __str__(self) -> str:
        return self.message


class BadRequest(ApiError, ValueError):
    status = 400
    code = grpc.StatusCode.INVALID_ARGUMENT
    type = "invalid_request_error"


class TooLarge(BadRequest):
    """A body larger than the door reads (`FrontDoorConfig.max_request_mb`), refused unread."""

    status = 413
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ClientGone(ApiError):
    """The client left while its body was being read: the answer reaches no one (nginx's
    499), but ends the request as an answer, not as an exception Serve logs at length."""

    status = 499
    code = grpc.StatusCode.CANCELLED
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    code = grpc.StatusCode.UNAUTHENTICATED
    type = "authentication_error"


class ModelNotFound(ApiError):
    status = 404
    code = grpc.StatusCode.NOT_FOUND
    type = "not_found_error"


@dataclass
class Rejected(ApiError):
    """The backup policy declined the request: no replica could guarantee its SLO."""

    retry_after_s: float | None = 1.0

    status = 429
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    type = "rate_limit_error"


@dataclass
class NoRoute(ApiError):
    """A path the HTTP door does not serve (404), or a method its path does not take (405);
    HTTP's alone. Typed as OpenAI types an unknown URL, not as `ModelNotFound`."""

    status: int = 404

    type = "invalid_request_error"


class InternalError(ApiError):
    """A fault of the server's own ended the request: the client learns that it ended and
    that it is not its fault; the server's log has the details."""

    @classmethod
    def of(cls, fault: BaseException) -> InternalError:
        return cls(f"the server failed this request ({type(fault).__name__}); its log says why")


class Unavailable(ApiError):
    """No replica is up (within the cluster's arrival wait); the request was not started."""

    status = 503
    code = grpc.StatusCode.UNAVAILABLE
    type = "service_unavailable"


def refuse_unknown(
    fields: Iterable[object], allowed: Collection[str], where: str, hint: str = ""
) -> None:
    """A 400 naming the first of an object's fields that is not `allowed`, its param that
    field's place in the body (`where`.field)."""
    unknown = sorted(str(k)[:64] for k in fields if k not in allowed)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]} is not a field{hint}", f"{where}.{unknown[0]}")
