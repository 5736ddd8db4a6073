"""Every error a user can cause is a KvcompileError subclass whose message says what to change."""


class KvcompileError(Exception):
    """Base class: bad input or an unsupported request. The engine stays usable after one."""


class ModelFileError(KvcompileError):
    """The model file is missing, truncated, corrupt or not a GGUF/safetensors checkpoint."""


class UnsupportedModelError(KvcompileError):
    """The architecture, a tensor type or a model feature is not supported."""


class ContextLengthError(KvcompileError):
    """The prompt (plus requested tokens) does not fit in the context."""


class SamplingError(KvcompileError):
    """A sampling parameter is out of range."""


class KvLayoutError(KvcompileError):
    """A KV page format, head geometry or span plan is invalid."""


class ArenaError(KvcompileError):
    """The GPU arena cannot hold the requested layout."""


class ProgramError(KvcompileError):
    """A step's program cannot run: the traced forward hit a limit, or a step was asked of
    a shape no program runs."""


class DeviceError(KvcompileError):
    """The requested device does not exist or this torch build cannot use it."""


class StreamInterruptedError(KvcompileError):
    """A stream was read after a newer request on the same Engine took over its cache.
    `result`: what the stream generated before, with finish_reason "interrupted"."""

    result = None


class SessionError(KvcompileError):
    """A saved session cannot be loaded: another model's, a newer format, a truncated file,
    or a name that leaves the session directory."""


class OpInputError(KvcompileError, ValueError):
    """A kvcompile row op (rms_norm, rope_rotate, silu_mul) got inputs that do not fit
    together."""
