"""Errors a user sees. Each names what was wrong and where."""


class IntoneError(Exception):
    """Base class: the CLI prints these without a traceback and exits non-zero."""


class ModelLoadError(IntoneError):
    """A model directory is missing, malformed, or does not match the architecture."""


class InvalidRequestError(IntoneError):
    """A request field is invalid. `field` names it, for API error bodies."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # crosses process boundaries (the API's text workers) whole
        return type(self), (self.field, self.message)


class MediaTooLarge(InvalidRequestError):
    """Media over the server's size limit: answered with 413."""
