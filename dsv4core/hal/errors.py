"""Exceptions raised by the HAL. Every message names the op (or backend) it is about."""


class HALError(RuntimeError):
    """Base class for HAL errors (registration, selection, binding)."""


class OpInputError(ValueError):
    """An op was called with an argument of the wrong rank, dtype or shape.

    The message has the form ``<op>: argument '<arg>' expected <expected>, got <actual>``.
    """

    def __init__(self, op: str, arg: str, expected: str, actual: str):
        self.op, self.arg, self.expected, self.actual = op, arg, expected, actual
        super().__init__(f"{op}: argument '{arg}' expected {expected}, got {actual}")


class RegistrationError(HALError):
    """A backend tried to register an implementation that does not match the op contract."""


class BackendNotFoundError(HALError):
    """An explicitly requested backend is unknown, failed to load, or is unavailable."""


class FallbackError(HALError):
    """Raised under the ``strict`` policy when an op would fall back to another backend."""
