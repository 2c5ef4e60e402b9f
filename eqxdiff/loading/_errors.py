"""The errors a user meets when loading: a checkpoint that does not fit, cannot be read, or cannot be converted."""


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into, or cannot be read."""


class ConversionError(CheckpointError):
    """A conversion rule does not apply to a checkpoint: a source tensor is missing or has the wrong shape."""
