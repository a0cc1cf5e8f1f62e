"""User-facing errors.

Every failure a user can cause (a bad prompt, a damaged checkpoint, a stale cache) is raised
as a `UserError` with a one-line message; the CLI prints that line and exits non-zero, and
only `--verbose` shows a traceback. Programming errors stay ordinary exceptions.
"""


class UserError(Exception):
    """A problem with the user's input or files, described in one line."""


class CheckpointError(UserError):
    """A checkpoint folder, config or tensor file that cannot be used as it is."""


class PromptError(UserError):
    """A prompt or generation request the runtime refuses (empty, too long, bad numbers)."""


class KernelCacheError(UserError):
    """A kernel cache entry or folder that cannot be used."""


class DeviceUnavailableError(UserError):
    """The device the user asked for (DEVICE=npu) is not usable on this machine."""


class ContextError(UserError):
    """A context length the model or the machine cannot hold (MAX_CONTEXT)."""
