"""Errors users can act on. Every one is a ValueError whose message names the bad value and the fix."""


class BlockspecError(ValueError):
    """Base class: a configuration or input problem the user can fix."""


class ModelLoadError(BlockspecError):
    """A checkpoint folder, config or weight file is missing, malformed or inconsistent."""


class DraftConfigError(BlockspecError):
    """The DFlash draft configuration (mask token, layer ids, block size, shapes) is invalid."""


class RequestError(BlockspecError):
    """A generation request (prompt, sampling parameters, lengths) is invalid."""
