"""The small set of errors Sluice answers with, mapped to HTTP in one place.

Every error renders as OpenAI's error object: {"error": {"message", "type", "code", "param"}}.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SluiceError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class InvalidRequest(SluiceError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(SluiceError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(SluiceError):
    status = 403
    error_type = "permission_error"
    code = "traffic_class_not_allowed"


class ModelNotFound(SluiceError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(SluiceError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ResourceNotFound(RouteNotFound):
    """An unknown or expired resource (a generation, a file, a batch), or another tenant's:
    the same answer for each."""


class MethodNotAllowed(SluiceError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(SluiceError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class IdempotencyKeyReused(SluiceError):
    status = 422
    error_type = "invalid_request_error"
    code = "idempotency_key_reused"


class GenerationCancelled(SluiceError):
    """The generation was cancelled: its client left or said cancel, or no one read it."""

    status = 499
    error_type = "invalid_request_error"
    code = "cancelled"


class TenantQuotaExceeded(SluiceError):
    status = 429
    error_type = "rate_limit_error"
    code = "tenant_quota_exceeded"


class TooManyFailedAttempts(SluiceError):
    status = 429
    error_type = "rate_limit_error"
    code = "too_many_failed_attempts"


class Overloaded(SluiceError):
    status = 503
    error_type = "server_error"
    code = "overloaded"


class DeadlineUnmeetable(SluiceError):
    status = 503
    error_type = "server_error"
    code = "deadline_unmeetable"


class ShuttingDown(SluiceError):
    status = 503
    error_type = "server_error"
    code = "shutting_down"


class DeadlineExceeded(SluiceError):
    status = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"


class EngineUnavailable(SluiceError):
    status = 503
    error_type = "server_error"
    code = "engine_unavailable"


class GenerationFailed(SluiceError):
    status = 500
    error_type = "server_error"
    code = "generation_failed"


class StateUnavailable(Exception):
    """The state replicas share (Redis) did not answer in time, or refused the connection.
    Never a client's answer: each feature that shares state says what it does without it."""


def restored(status: int, body: dict[str, Any], retry_after: float | None = None) -> SluiceError:
    """The error that rendered as `body` with `status` (one logged by another replica)."""
    error = body.get("error") or {}
    code = error.get("code")
    classes = [SluiceError]
    while classes:
        cls = classes.pop()
        if cls.code == code and cls.status == status:
            break
        classes.extend(cls.__subclasses__())
    else:
        cls = GenerationFailed if status >= 500 else InvalidRequest
    return cls(str(error.get("message", "")), param=error.get("param"), retry_after=retry_after)
