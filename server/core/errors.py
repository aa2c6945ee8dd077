"""The small set of errors Sluice answers with, mapped to HTTP in one place.

Every error renders as OpenAI's error object: {"error": {"message", "type", "code", "param"}}.
Each class says everything Sluice knows about its answer: the HTTP status, OpenAI's `type`,
the `code`, the `outcome` its request is counted under (sluice_requests_total), whether the
client may retry it later (`retryable`: a batch line retries it, and the answer carries
Retry-After where Sluice can tell when), and whether it is a `capacity` refusal (the
service's own, not the tenant's: it counts as a missed SLO). The tables other modules need
(`ERRORS`, `REJECTION_CODES`) are derived from the classes here, never written by hand.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

# How a request ended: the `outcome` label of sluice_requests_total.
Outcome = Literal["completed", "cancelled", "rejected", "expired", "failed", "invalid"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

# Each distinct answer's class, by (status, code), filled as each class is defined. A subclass
# that keeps its parent's status and code (ResourceNotFound) is the same answer: the parent
# stands for it.
ERRORS: dict[tuple[int, str], type[SluiceError]] = {}


class SluiceError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    outcome: ClassVar[Outcome] = "failed"
    retryable: ClassVar[bool] = False
    capacity: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ERRORS.setdefault((cls.status, cls.code), cls)

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


ERRORS[(SluiceError.status, SluiceError.code)] = SluiceError


class InvalidRequest(SluiceError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"
    outcome = "invalid"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class MutuallyExclusiveParameters(InvalidRequest):
    code = "mutually_exclusive_parameters"


class ConversationLocked(InvalidRequest):
    """A response runs on the conversation: another, or a change to its items, waits for its
    end (OpenAI's answer, a 400)."""

    code = "conversation_locked"


class StorageLimitExceeded(InvalidRequest):
    """What a tenant keeps is at a bound of the configuration (its conversations, their
    items): nothing was changed."""

    code = "storage_limit_exceeded"


class Unauthorized(SluiceError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"
    outcome = "rejected"


class Forbidden(SluiceError):
    status = 403
    error_type = "permission_error"
    code = "forbidden"
    outcome = "rejected"


class ModelNotFound(SluiceError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
    outcome = "invalid"


class RouteNotFound(SluiceError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"
    outcome = "invalid"


class ResourceNotFound(RouteNotFound):
    """An unknown or expired resource (a generation, a file, a batch), or another tenant's:
    the same answer for each."""


class MethodNotAllowed(SluiceError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"
    outcome = "invalid"


class PayloadTooLarge(SluiceError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"
    outcome = "invalid"


class IdempotencyKeyReused(SluiceError):
    status = 422
    error_type = "invalid_request_error"
    code = "idempotency_key_reused"
    outcome = "invalid"


class GenerationCancelled(SluiceError):
    """The generation was cancelled: its client left or said cancel, or no one read it."""

    status = 499
    error_type = "invalid_request_error"
    code = "cancelled"
    outcome = "cancelled"


class TenantQuotaExceeded(SluiceError):
    status = 429
    error_type = "rate_limit_error"
    code = "tenant_quota_exceeded"
    outcome = "rejected"
    retryable = True


class TooManyFailedAttempts(SluiceError):
    status = 429
    error_type = "rate_limit_error"
    code = "too_many_failed_attempts"
    outcome = "rejected"
    retryable = True


class Overloaded(SluiceError):
    status = 503
    error_type = "server_error"
    code = "overloaded"
    outcome = "rejected"
    retryable = True
    capacity = True


class DeadlineUnmeetable(SluiceError):
    status = 503
    error_type = "server_error"
    code = "deadline_unmeetable"
    outcome = "rejected"
    retryable = True
    capacity = True


class ShuttingDown(SluiceError):
    status = 503
    error_type = "server_error"
    code = "shutting_down"
    outcome = "rejected"
    retryable = True


class DeadlineExceeded(SluiceError):
    status = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"
    outcome = "expired"


class EngineUnavailable(SluiceError):
    status = 503
    error_type = "server_error"
    code = "engine_unavailable"
    outcome = "rejected"
    retryable = True
    capacity = True


class StoreUnavailable(SluiceError):
    """The store of the Batch API's files and batches, or of conversations, did not answer
    (Redis, with `state.url`): nothing was changed, and the same call may be made again."""

    status = 503
    error_type = "server_error"
    code = "store_unavailable"
    outcome = "rejected"
    retryable = True


class AdapterLoadError(SluiceError):
    """A LoRA adapter's files could not be loaded: answered as vLLM's server does (500)."""

    status = 500
    error_type = "server_error"
    code = "adapter_load_failed"


class GenerationFailed(SluiceError):
    status = 500
    error_type = "server_error"
    code = "generation_failed"


# The codes of refusals: the `reason` label of sluice_rejections_total.
REJECTION_CODES: tuple[str, ...] = tuple(
    code for (_, code), cls in ERRORS.items() if cls.outcome == "rejected"
)


def transient(cls: type[SluiceError]) -> bool:
    """Whether a refusal passes by itself, so that a batch line waits it out and is offered
    again: a retryable one, or a conversation another response holds (OpenAI's 400, which
    says to retry in a few seconds)."""
    return cls.retryable or issubclass(cls, ConversationLocked)


# The codes of those refusals: the `code` label of sluice_batch_line_retries_total.
TRANSIENT_CODES: tuple[str, ...] = tuple(
    code for (_, code), cls in ERRORS.items() if transient(cls)
)


def outcome_of(status: int) -> Outcome:
    """How a request answered with `status` ended, when all Sluice knows is the status: the
    outcome its error classes share ("completed" below 400)."""
    if status < 400:
        return "completed"
    outcomes = {cls.outcome for (code_status, _), cls in ERRORS.items() if code_status == status}
    if len(outcomes) == 1:
        return outcomes.pop()
    return "failed" if status >= 500 else "invalid"


class StateUnavailable(Exception):
    """The state replicas share (Redis) did not answer in time, or refused the connection.
    Never a client's answer: each feature that shares state says what it does without it."""


def restored(status: int, body: dict[str, Any], retry_after: float | None = None) -> SluiceError:
    """The error that rendered as `body` with `status` (one logged by another replica)."""
    error = body.get("error") or {}
    code = error.get("code")
    cls = ERRORS.get((status, code)) if isinstance(code, str) else None
    if cls is None:
        cls = GenerationFailed if status >= 500 else InvalidRequest
    return cls(str(error.get("message", "")), param=error.get("param"), retry_after=retry_after)
