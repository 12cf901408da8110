"""Errors that carry the name of the offending field, so every entry point can answer clearly."""


class InvalidRequestError(ValueError):
    """A request field has a value the engine refuses; `param` names the field (OpenAI's)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class StartUpError(RuntimeError):
    """A service cannot start, for a reason one line says (the scheduler refused a worker, or
    did not answer): `tandem` prints it and exits 1, where a traceback told it before."""
