"""diffusers' pipeline methods beyond the call that eqxdiff does as diffusers does, on
:class:`~eqxdiff.pipelines.DiffusionPipeline`: :meth:`DiffusersApiMixin.from_single_file`,
:meth:`DiffusersApiMixin.set_progress_bar_config`."""

import os
from pathlib import Path

from ..loading import CheckpointError

__all__ = ["DiffusersApiMixin"]


class DiffusersApiMixin:
    """diffusers' pipeline methods beyond the call (see the module docstring)."""

    @classmethod
    def from_single_file(cls, pretrained_model_link_or_path, *, config=None, revision: str | None = None, **kwargs):
        """This pipeline from a single ``.safetensors`` checkpoint (diffusers' ``from_single_file``): ``config`` (a
        diffusers folder or Hub id) gives what the file lacks, ``revision`` that of a Hub ``config``; ``kwargs``
        are :func:`~eqxdiff.load_pipeline`'s (``dtype=`` ...). A folder or Hub id is :meth:`from_pretrained`'s."""
        from ._base import load_pipeline

        path = Path(os.fspath(pretrained_model_link_or_path)).expanduser()
        if not path.is_file():
            raise CheckpointError(f"{cls.__name__}.from_single_file({os.fspath(pretrained_model_link_or_path)!r}): "
                                  "no such file; it takes a single .safetensors checkpoint on disk (fetch one from the "
                                  "Hub with huggingface_hub.hf_hub_download); a folder or Hub id is from_pretrained's")
        return load_pipeline(path, pipeline_class=cls, config=config, revision=revision, **kwargs)

    def set_progress_bar_config(self, disable: bool = False, **kwargs) -> None:
        """Whether this pipeline's calls show a progress bar by default (diffusers'
        ``set_progress_bar_config(disable=True)``): the default of the calls' ``progress=``, carried by
        ``from_pipe`` / ``with_scheduler`` and not saved. eqxdiff's bar takes no other tqdm settings."""
        if kwargs:
            raise TypeError(f"set_progress_bar_config takes only disable= (the default of the calls' progress=), not "
                            f"{sorted(kwargs)}: eqxdiff draws its progress bar itself")
        if not isinstance(disable, bool):
            raise TypeError(f"set_progress_bar_config: disable={disable!r} must be True or False")
        self.call_defaults = {**self.call_defaults, "progress": not disable}
