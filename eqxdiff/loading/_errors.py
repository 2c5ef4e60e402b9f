"""The errors a user meets when loading: a checkpoint that does not fit, cannot be read, or cannot be converted."""

import os

# PyTorch pickle checkpoints, which eqxdiff refuses to unpickle (:func:`pickle_error` says how to convert them).
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into, or cannot be read."""


class ConversionError(CheckpointError):
    """A conversion rule does not apply to a checkpoint: a source tensor is missing or has the wrong shape."""


def pickle_error(path: str | os.PathLike) -> CheckpointError:
    """The error for a PyTorch pickle checkpoint at ``path`` (a ``.ckpt``/``.pt``/``.pth``/``.bin`` file): eqxdiff
    reads only safetensors, and how to convert the file once. The one message for every entry point (``load``,
    ``load_pipeline``, ``eqxdiff-generate``)."""
    name = os.path.basename(os.fspath(path))
    return CheckpointError(
        f"{os.fspath(path)!r} is a PyTorch pickle; eqxdiff reads only .safetensors files (a pickle can run code "
        "when loaded). Convert it once where you trust it, with diffusers: "
        f"`StableDiffusionPipeline.from_single_file({name!r}).save_pretrained('folder')` (eqxdiff loads the "
        "folder), or with safetensors: `sd = torch.load(path, map_location='cpu', weights_only=True); "
        "sd = sd.get('state_dict', sd); safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items() "
        "if torch.is_tensor(v)}, 'model.safetensors')`")
