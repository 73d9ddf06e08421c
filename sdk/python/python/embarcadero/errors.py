"""The exceptions of the client, one per kind of `embarcadero_client::Error`.

The native module raises these (it looks the classes up here), so each carries the same
message text the `embarcadero` CLI prints after ``error:``, and the details as attributes.
"""

from __future__ import annotations

import builtins
from typing import Optional


class EmbarcaderoError(Exception):
    """Base of every error the client raises."""


class ConnectError(EmbarcaderoError, ConnectionError):
    """The control plane or a broker could not be reached.

    ``what`` says which (``"the control plane"``, ``"broker"``), ``addr`` where.
    """

    def __init__(self, message: str, *, what: str = "", addr: str = "") -> None:
        super().__init__(message)
        self.what = what
        self.addr = addr


class ConnectionLostError(EmbarcaderoError, ConnectionError):
    """An open connection to broker ``broker`` failed (and reconnecting did not help)."""

    def __init__(self, message: str, *, broker: str = "") -> None:
        super().__init__(message)
        self.broker = broker


class BrokerError(EmbarcaderoError):
    """A broker refused a request.

    ``code`` is the broker's ErrorCode name (``"UnknownTopic"``), ``code_number`` its
    number on the wire (3), ``broker`` the broker's address.
    """

    def __init__(
        self, message: str, *, broker: str = "", code: str = "", code_number: int = 0
    ) -> None:
        super().__init__(message)
        self.broker = broker
        self.code = code
        self.code_number = code_number


class AdminError(EmbarcaderoError):
    """The control plane's admin API answered with an error; ``status`` is the HTTP status."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ProtocolError(EmbarcaderoError):
    """A peer sent something the protocol does not allow (``peer`` says who)."""

    def __init__(self, message: str, *, peer: str = "") -> None:
        super().__init__(message)
        self.peer = peer


class MessageTooLargeError(EmbarcaderoError, ValueError):
    """A message of ``size`` bytes is over the brokers' maximum of ``max`` bytes."""

    def __init__(self, message: str, *, size: int = 0, max: int = 0) -> None:
        super().__init__(message)
        self.size = size
        self.max = max


class ConfigError(EmbarcaderoError, ValueError):
    """An option or argument the client cannot use (checked before anything is sent)."""


class InvalidNameError(EmbarcaderoError, ValueError):
    """A topic name the server would refuse (checked before any request is sent)."""


class TimeoutError(EmbarcaderoError, builtins.TimeoutError):
    """Waiting (for a flush, say) took longer than allowed; ``timeout`` is in seconds.

    A subclass of the built-in ``TimeoutError`` too, so ``except TimeoutError`` catches it.
    """

    def __init__(self, message: str, *, timeout: Optional[float] = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class ClosedError(EmbarcaderoError):
    """The publisher (or subscriber) is closed."""


class NoLiveBrokerError(EmbarcaderoError):
    """No live broker is left to publish to."""


class WorkflowApiError(EmbarcaderoError):
    """The workflow engine's API answered with an error, or nothing answered.

    ``status`` is the HTTP status (0 when nothing answered), ``code`` the API's error code
    (``"not_found"``, ``"template_not_found"``, ``"task_closed"``, ``"backpressure"``,
    ``"invalid_template"``...; ``"unreachable"`` when nothing answered). ``docs/WORKFLOW.md``
    lists each route's codes.
    """

    def __init__(self, message: str, *, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


__all__ = [
    "AdminError",
    "BrokerError",
    "ClosedError",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "EmbarcaderoError",
    "InvalidNameError",
    "MessageTooLargeError",
    "NoLiveBrokerError",
    "ProtocolError",
    "TimeoutError",
    "WorkflowApiError",
]
