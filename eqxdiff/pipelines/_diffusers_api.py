"""diffusers' pipeline methods and attributes beyond the call, on :class:`~eqxdiff.pipelines.DiffusionPipeline`:
the few eqxdiff does as diffusers does (:meth:`DiffusersApiMixin.from_single_file`,
:meth:`DiffusersApiMixin.set_progress_bar_config`), and, for the rest, an
:class:`UnsupportedPipelineAttribute` (an ``AttributeError``) whose message says what to do instead
(:data:`NOT_OFFERED`), so that a notebook ported from diffusers learns the eqxdiff way at the line that fails.

The table covers every public name of the diffusers namesake of each class eqxdiff serves that eqxdiff's class lacks
(tests/test_pipeline.py checks it), on an instance and on the class (``StableDiffusionPipeline.from_config``, through
the pipelines' metaclass). Only a failed lookup reaches it (``__getattr__``): real attributes, ``hasattr``
(False for these names), copying and pickling (whose dunder look-ups get the plain ``AttributeError``) are untouched.
"""

import os
from pathlib import Path
from typing import Any

from ..loading import CheckpointError
from ._call import NOT_TAKEN

__all__ = ["NOT_OFFERED", "DiffusersApiMixin", "UnsupportedPipelineAttribute"]


class UnsupportedPipelineAttribute(AttributeError):
    """A diffusers pipeline method or attribute eqxdiff does not have; the message says what to do instead."""


_PLACED = ("eqxdiff places the weights when it loads them: load_pipeline(..., dtype=, activations_dtype=, mesh=) "
           "(a mesh from eqxdiff.parallel.make_mesh shards them over its devices); there is nothing to move after")
_OFFLOAD = ("pass offload_encoders=True to load_pipeline / from_pretrained (the text and image encoders stay in host "
            "memory and are on the devices only while they encode); a pipeline with several denoisers may also keep "
            "them in host memory (its enable_expert_offload / offload_experts)")
_HOOKS = "eqxdiff places no torch hooks or device maps: " + _PLACED
_ATTENTION = ("eqxdiff picks the attention kernel at load: load_pipeline(..., attention='chunked') (O(seq) memory; "
              "'flash', 'cudnn', 'xla' ...: eqxdiff.kernels); there is no slicing or processor to set")
_CONFIG = ("eqxdiff pipelines have no config object: pipe.components and pipe.options hold what model_index.json "
           "lists, save_pretrained(folder) writes it, and eqxdiff.load_pipeline(folder) reads it")
_IN_CALL = ("a value of the running call, read by diffusers' step callbacks; eqxdiff runs the denoising loop as one "
            "compiled program without callbacks: the call's own arguments are what it uses")
_STEP = ("one of diffusers' internal call steps; eqxdiff's call does it itself: pass the call's arguments "
         "(output_type='latent' returns the final latents, pipe.decode(latents) decodes them)")
_NO_IP_ADAPTER = NOT_TAKEN["ip_adapter_image"]  # the call argument's wording
_LORA = ("eqxdiff's LoRA methods are load_lora_weights (into every model the file adapts; hotswap=True swaps an "
         "adapter's weights in place), set_adapters, get_active_adapters, get_list_adapters, lora_adapters, "
         "enable_lora / disable_lora, fuse_lora / unfuse_lora, delete_adapters and unload_lora_weights")
_FUSED = "pipe.lora_adapters() lists the loaded adapters, each with whether it is fused"
_FUSED_QKV = ("the query, key and value projections of this pipeline's models run as diffusers' separate layers; "
              "where a model has fused projections it is load_pipeline(..., config_overrides={component: "
              "{'fused_projections': True}})")

# diffusers' pipeline methods and attributes eqxdiff does not have, by design or not yet, with what to do instead.
NOT_OFFERED: dict[str, str] = {
    # placement and offload
    "to": _PLACED,
    "device": "eqxdiff pipelines have no single device: the weights are placed at load (pipe.mesh, jax.devices())",
    "dtype": ("eqxdiff separates the weights' dtype (load_pipeline's dtype=) from that of the latents and activations: "
              "pipe.activations_dtype"),
    "enable_model_cpu_offload": _OFFLOAD,
    "enable_sequential_cpu_offload": _OFFLOAD,
    "enable_group_offload": _OFFLOAD,
    "maybe_free_model_hooks": _HOOKS,
    "remove_all_hooks": _HOOKS,
    "reset_device_map": _HOOKS,
    "hf_device_map": _HOOKS,
    "model_cpu_offload_seq": _OFFLOAD,
    # attention
    "enable_attention_slicing": _ATTENTION,
    "disable_attention_slicing": _ATTENTION,
    "set_attention_slice": _ATTENTION,
    "enable_xformers_memory_efficient_attention": _ATTENTION,
    "disable_xformers_memory_efficient_attention": _ATTENTION,
    "set_use_memory_efficient_attention_xformers": _ATTENTION,
    "fuse_qkv_projections": _FUSED_QKV,
    "unfuse_qkv_projections": _FUSED_QKV,
    "upcast_vae": ("the VAE runs in float32 where its config asks (force_upcast) under float16 activations; or load "
                   "with activations_dtype='float32'"),
    # configuration, saving, the Hub
    "config": _CONFIG,
    "parameters": "the pipeline's own settings are pipe.options (model_index.json's entries that are not components)",
    "name_or_path": "eqxdiff does not keep where a pipeline was loaded from: keep the path you passed",
    "config_name": _CONFIG,
    "ignore_for_config": _CONFIG,
    "has_compatibles": _CONFIG,
    "from_config": _CONFIG,
    "load_config": _CONFIG,
    "get_config_dict": _CONFIG,
    "extract_init_dict": _CONFIG,
    "save_config": _CONFIG,
    "register_to_config": _CONFIG,
    "register_modules": ("components are set when the pipeline is built: Cls(**pipe.components, name=model) or "
                         "Cls.from_pipe(pipe, name=model)"),
    "register_for_auto_class": "eqxdiff finds a folder's class through its family table (eqxdiff.core.resolve_class)",
    "to_json_file": _CONFIG,
    "to_json_string": _CONFIG,
    "download": ("eqxdiff.load_pipeline(hub_id) downloads what it reads (huggingface_hub.snapshot_download fetches a "
                 "whole repository)"),
    "push_to_hub": "pipe.save_pretrained(folder), then huggingface_hub.upload_folder(repo_id=..., folder_path=folder)",
    # the running call (diffusers' properties for callbacks)
    **dict.fromkeys(("attention_kwargs", "cross_attention_kwargs", "joint_attention_kwargs", "clip_skip",
                     "guidance_scale", "guidance_rescale", "do_classifier_free_guidance", "denoising_start",
                     "denoising_end", "num_timesteps", "current_timestep", "interrupt"), _IN_CALL),
    # diffusers' internal steps of a call
    **dict.fromkeys(("check_inputs", "check_image", "prepare_latents", "prepare_extra_step_kwargs", "prepare_image",
                     "prepare_control_image", "prepare_mask_latents", "get_timesteps", "get_guidance_scale_embedding",
                     "adain_filter_latent", "tone_map_latents", "trim_conditioning_sequence",
                     "add_noise_to_image_conditioning_latents", "progress_bar"), _STEP),
    "decode_latents": "pipe.decode(latents) (latents as output_type='latent' returns them)",
    "encode_prompt": ("pass the call prompt_embeds= / negative_prompt_embeds= (and pooled_prompt_embeds= / "
                      "negative_pooled_prompt_embeds= where it takes them) to reuse embeddings"),
    "run_safety_checker": "eqxdiff runs no safety checker (a folder's safety_checker is ignored)",
    "numpy_to_pil": ("eqxdiff returns uint8 arrays: PIL.Image.fromarray(image) for each, or "
                     "eqxdiff.pipelines.save_images"),
    # IP-Adapter
    **dict.fromkeys(("load_ip_adapter", "unload_ip_adapter", "set_ip_adapter_scale", "encode_image"), _NO_IP_ADAPTER),
    "prepare_ip_adapter_image_embeds": ("pass the call ip_adapter_image= (or its embeddings, ip_adapter_image_embeds=: "
                                        "[negative; positive] rows of pipe.encode_image(image) with guidance)"),
    # LoRA methods beyond eqxdiff's
    **dict.fromkeys(("enable_lora_hotswap", "load_lora_into_text_encoder", "load_lora_into_transformer",
                     "load_lora_into_unet", "lora_state_dict", "pack_weights", "text_encoder_name", "transformer_name",
                     "unet_name"), _LORA),
    "fused_loras": _FUSED,
    "num_fused_loras": _FUSED,
    "lora_scale": ("a call's LoRA scale is the call's own argument (cross_attention_kwargs / joint_attention_kwargs / "
                   "attention_kwargs={'scale': s}, as its diffusers namesake takes it); set_adapters sets strengths"),
    "set_lora_device": ("adapters are placed with their model's weights (load_pipeline's mesh=); there is nothing to "
                        "move"),
    **dict.fromkeys(("save_lora_weights", "write_lora_layers"),
                    "eqxdiff writes no LoRA files: fuse_lora() then save_pretrained(folder) writes the fused weights"),
}


def _unsupported(owner: str, name: str, obj) -> AttributeError:
    """The error for a diffusers pipeline name eqxdiff's ``owner`` lacks: what to do instead, or Python's own."""
    if name in NOT_OFFERED:
        return UnsupportedPipelineAttribute(f"{owner} has no {name!r} (a diffusers pipeline's): {NOT_OFFERED[name]}",
                                            name=name, obj=obj)
    what = f"type object {owner!r}" if isinstance(obj, type) else f"{owner!r} object"
    return AttributeError(f"{what} has no attribute {name!r}", name=name, obj=obj)


class _DiffusersApiType(type):
    """The pipelines' metaclass: a class-level lookup of a diffusers name (``StableDiffusionPipeline.from_config``)
    says what to do instead, as an instance's does."""

    def __getattr__(cls, name: str) -> Any:  # only reached when the normal lookup fails
        raise _unsupported(cls.__name__, name, cls)


class DiffusersApiMixin(metaclass=_DiffusersApiType):
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

    def __getattr__(self, name: str) -> Any:
        # Only reached when the normal lookup fails; reads nothing of self (no recursion while unpickling).
        raise _unsupported(type(self).__name__, name, self)
