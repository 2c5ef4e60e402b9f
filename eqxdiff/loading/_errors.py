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
        f"{os.fspath(path)!r} is a PyTorch pickle; {_REFUSAL} Convert it once where you trust it, with diffusers: "
        f"`StableDiffusionPipeline.from_single_file({name!r}).save_pretrained('folder')` (eqxdiff loads the "
        f"folder), or {_SAFETENSORS_ONE_LINER}")


def pickle_folder_error(folder: str | os.PathLike, names: list[str]) -> CheckpointError:
    """The error for a model folder whose weights are only PyTorch pickles (``names``): :func:`pickle_error`'s
    refusal and conversion, for a folder (a ``.ckpt`` in a component folder gets the hint a ``.ckpt`` passed
    directly gets)."""
    return CheckpointError(
        f"{os.fspath(folder)!r} holds only PyTorch pickle weights ({', '.join(names)}); {_REFUSAL} Convert them once "
        "where you trust them, with diffusers/transformers: `Model.from_pretrained(folder).save_pretrained(folder, "
        f"safe_serialization=True)`, or {_SAFETENSORS_ONE_LINER}")


_SCALES = ("scaled_fp8", "scale_weight", "scale_input")  # ComfyUI's scaled float8 files: a marker, per-layer scales


def check_not_scaled_float8(names, where: str) -> None:
    """Raise a :class:`CheckpointError` if ``names`` (a checkpoint's tensor names) are those of a ComfyUI "scaled"
    float8 file (``*_fp8_scaled.safetensors``: a ``scaled_fp8`` marker, a ``scale_weight`` per layer): its float8
    weights are stored divided by those scales, so read without them they would be wrong (diffusers'
    ``from_single_file`` drops the scales with a warning), and a fused tensor's scale fails its conversion rule with
    a message about shapes. Checked on the file's names before any rule runs."""
    scales = [n for n in names if n.rsplit(".", 1)[-1] in _SCALES]
    if scales:
        raise CheckpointError(
            f"{where} is a ComfyUI scaled float8 file (*_fp8_scaled: {len(scales)} tensors such as {scales[0]!r} hold "
            "per-layer scales its float8 weights are stored divided by), which eqxdiff does not read; load a "
            "bfloat16 / float16 release of the model, or a plain float8_e4m3fn one (cast to dtype=)")


_REFUSAL = "eqxdiff reads only .safetensors files (a pickle can run code when loaded)."
_SAFETENSORS_ONE_LINER = (
    "with safetensors: `sd = torch.load(path, map_location='cpu', weights_only=True); sd = sd.get('state_dict', sd); "
    "safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items() if torch.is_tensor(v)}, "
    "'model.safetensors')`")
