"""Errors a user can act on: each names what was tried and what to do."""


class EyasError(Exception):
    """Base of the errors eyas raises for bad input or a broken setup (not for its own bugs)."""


class TargetNotFoundError(EyasError):
    """The target spec resolved to nothing loadable; the message lists what was tried."""


class LayoutError(EyasError):
    """The decoder stack, embedding, final norm or lm_head could not be found; lists what was found."""


class CaptureError(EyasError):
    """Hidden-state capture saw something wrong (a hook bypassed, fired twice, wrong token count)."""


class OptionError(EyasError):
    """An option's value outside what its field allows (``option(check=...)``): names the option, the value, the range."""

    def __init__(self, owner: str, name: str, value: object, rule: str):
        self.name, self.value, self.rule = name, value, rule
        super().__init__(f"{owner}.{name} = {value!r}: {rule}")
