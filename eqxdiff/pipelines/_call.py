"""A pipeline call's wrapper: :func:`checked_call` decorates every family's ``__call__`` (its arguments checked before
anything is encoded or compiled, the call and its stages timed with the seconds JAX spent compiling), and
:func:`compile_seconds`, the compile clock behind :meth:`DiffusionPipeline.timed
<eqxdiff.pipelines.DiffusionPipeline.timed>`."""

import contextvars
import functools
import inspect
import re
from collections.abc import Mapping

import jax

from ._checks import InputError, InputTypeError
from ._lora_scale import call_lora_scale

__all__ = ["COMPILE_SUFFIX", "NOT_TAKEN", "call_argument_names", "check_call_class", "checked_call", "compile_seconds",
           "is_checked"]

COMPILE_SUFFIX = "_compile"  # timings[stage + COMPILE_SUFFIX]: the compile seconds within timings[stage]
CHECKED = "__checks_arguments__"  # the attribute checked_call sets on the functions it returns


class _CompileClock:
    """Seconds JAX has spent compiling in this process: its ``/jax/core/compile/`` duration events (tracing to a
    jaxpr, lowering to MLIR, XLA's compile), summed by one listener, registered on first use."""

    seconds = 0.0
    _registered = False

    @classmethod
    def now(cls) -> float:
        if not cls._registered:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True
        return cls.seconds

    @classmethod
    def _on_event(cls, name: str, duration: float, **_) -> None:
        if name.startswith("/jax/core/compile/"):
            cls.seconds += duration


def compile_seconds() -> float:
    """Seconds this process has spent compiling JAX programs (tracing, lowering and XLA's compile) since the first
    reading; the difference of two readings is the compile time between them (what
    :meth:`~eqxdiff.pipelines.DiffusionPipeline.timed` records)."""
    return _CompileClock.now()


_IN_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("eqxdiff_pipeline_call", default=False)


_CALLBACKS = ("the denoising loop is one compiled program, so no Python runs between its steps: pass "
              "output_type='latent' to get the final latents, or progress=True for a progress bar")
_NO_IP_ADAPTER = ("this pipeline takes no IP-Adapter (eqxdiff's SD and SDXL pipelines do: load_ip_adapter): "
                  "describe the image in the prompt, or use image-to-image (image=)")

# diffusers' call arguments eqxdiff does not take by design, with what to do instead: the unexpected-keyword error of a
# call that passes one says it.
NOT_TAKEN: dict[str, str] = {
    "generator": "eqxdiff draws its noise from seed= (an int) or key= (a jax.random key), not a torch.Generator",
    "return_dict": "eqxdiff returns the images (or videos) themselves, not an output object: drop it",
    "callback_on_step_end": _CALLBACKS,
    "callback_on_step_end_tensor_inputs": _CALLBACKS,
    "callback": _CALLBACKS,
    "callback_steps": _CALLBACKS,
    "ip_adapter_image": _NO_IP_ADAPTER,
    "ip_adapter_image_embeds": _NO_IP_ADAPTER,
    "ip_adapter_masks": _NO_IP_ADAPTER,
    "negative_ip_adapter_image": _NO_IP_ADAPTER,
    "negative_ip_adapter_image_embeds": _NO_IP_ADAPTER,
    "masked_image_latents": "this pipeline takes no masked-image latents (the UNet inpainting pipelines do, for a "
                            "9-channel UNet, and Flux's Inpaint and Fill): pass image= and mask_image=",
    "padding_mask_crop": "this pipeline does not crop around the mask (diffusers' namesake neither); the inpainting "
                         "pipelines take padding_mask_crop=",
}
# diffusers' arguments that carry a call's LoRA scale, one per family ({"scale": s}).
LORA_SCALE_ARGUMENTS = ("cross_attention_kwargs", "joint_attention_kwargs", "attention_kwargs")


def _hint(error: TypeError, signature: inspect.Signature, cls: type) -> str:
    """What to pass instead of an unexpected keyword: the call's own underscore-led name of it (Kontext's
    ``_auto_resize``), the way eqxdiff does what a diffusers argument does (:data:`NOT_TAKEN`), or this family's
    LoRA-scale argument; else ``""``."""
    match = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    name = match.group(1) if match else None
    if name is None:
        return ""
    if "_" + name in signature.parameters:
        return f" (diffusers' name, which this call takes: _{name}=)"
    if name in NOT_TAKEN:
        return f" ({NOT_TAKEN[name]})"
    if name in LORA_SCALE_ARGUMENTS:
        own = getattr(cls, "LORA_SCALE_ARGUMENT", None)
        return (f" (a {cls.__name__} takes the call's LoRA scale as {own}={{'scale': s}})" if own else
                f" (a {cls.__name__} runs no LoRA adapters)")
    return ""


def check_call_class(cls: type) -> None:
    """Run when a pipeline class is defined: its own ``__call__`` must be wrapped by :func:`checked_call`, and a
    family that takes a LoRA scale (``LORA_SCALE_ARGUMENT``) shows that argument in the call's signature (what
    ``inspect.signature`` and ``eqxdiff-generate`` read; the wrapper takes it off before the call)."""
    call = cls.__dict__.get("__call__")
    if call is None:
        return
    if not is_checked(call):
        raise TypeError(f"{cls.__name__}.__call__ must be decorated with @checked_call (from eqxdiff.pipelines): "
                        "it checks the call's arguments before anything compiles and records the pipeline's timings")
    name = getattr(cls, "LORA_SCALE_ARGUMENT", None)
    signature = inspect.signature(call)
    if name is None or name in signature.parameters:
        return
    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    added = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=Mapping[str, float] | None)
    call.__signature__ = signature.replace(parameters=[*params[:at], added, *params[at:]])


def checked_call(call):
    """The decorator on every family's ``__call__`` (``@checked_call``). The call's arguments are bound to ``call``'s
    signature and checked before anything is encoded or compiled (the pipeline's
    :meth:`~eqxdiff.pipelines.DiffusionPipeline.check_arguments` with its
    :meth:`~eqxdiff.pipelines.DiffusionPipeline.call_limits`, then its ``check_call``), and the call is timed: the
    outermost call starts :attr:`~eqxdiff.pipelines.DiffusionPipeline.timings` afresh and records itself as
    ``"call"``; a call made inside it (a ControlNet pipeline passing its arguments on to its family's call) adds its
    stages. The family's LoRA-scale argument (``LORA_SCALE_ARGUMENT``: ``cross_attention_kwargs={"scale": s}`` ...)
    is taken off here and the outermost call runs with the adapters at ``s`` times their strength
    (:meth:`~eqxdiff.pipelines._lora_scale.LoraScaleMixin.lora_scaled`). The signature and docstring stay ``call``'s
    (``eqxdiff-generate`` reads them), plus that argument (:func:`check_call_class`). A pipeline class whose own
    ``__call__`` lacks it is refused when the class is defined."""
    signature = inspect.signature(call)
    params = list(signature.parameters.values())
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)

    def run(self, args, kwargs, outer: bool):
        cls, lora = type(self), getattr(self, "LORA_SCALE_ARGUMENT", None)
        kwargs = dict(kwargs)
        lora_given = lora in kwargs
        lora_value = kwargs.pop(lora) if lora_given else None  # the wrapper's: the call runs at its scale
        try:
            bound = signature.bind(self, *args, **kwargs)
            passed = set(bound.arguments.get(var_keyword, {}) if var_keyword else ())
            unknown = sorted(passed - call_argument_names(cls))  # what a call passing **kwargs on would refuse
            if unknown:
                raise TypeError(f"got an unexpected keyword argument '{unknown[0]}'")
            given = set(bound.arguments) | passed | ({lora} if lora_given else set())
            defaults = {k: v for k, v in getattr(self, "call_defaults", {}).items()
                        if k not in given and not (k == "seed" and "key" in given)}  # a key replaces the seed
            lora_value = defaults.pop(lora, lora_value) if lora else None
            if defaults:  # the folder's recommended values for what the call leaves out
                kwargs = {**kwargs, **defaults}
                bound = signature.bind(self, *args, **kwargs)
        except TypeError as e:
            raise InputTypeError(f"{cls.__name__}(...): {e}{_hint(e, signature, cls)}") from None
        lora_value, kwargs, bound = _own_arguments(lora, lora_value, kwargs, bound, signature, cls, self, args)
        scale = call_lora_scale(lora, lora_value) if lora and outer else 1.0  # (a call inside has it already)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != params[0].name and k != var_keyword}
        arguments.update(bound.arguments.get(var_keyword, {}) if var_keyword else {})
        self.check_arguments(arguments, self.call_limits())
        resolved = self.check_call(arguments) or {}  # what the checks resolved: the call takes it as it is
        with self.lora_scaled(scale):
            return call(self, *args, **{**kwargs, **resolved})

    @functools.wraps(call)
    def checked(self, *args, **kwargs):
        if _IN_CALL.get():
            return run(self, args, kwargs, outer=False)
        token = _IN_CALL.set(True)
        self.timings.clear()  # in place: a call's shallow copies of the pipeline share the dict
        try:
            with self.timed("call"):
                return run(self, args, kwargs, outer=True)
        finally:
            _IN_CALL.reset(token)

    setattr(checked, CHECKED, True)
    return checked


def _own_arguments(lora: str, value, kwargs: dict, bound, signature, cls: type, self, args) -> tuple:
    """``(value, kwargs, bound)`` with the keys of the LoRA-scale argument's dict that are this call's own arguments
    (diffusers' ``cross_attention_kwargs={"ip_adapter_masks": ...}``, which the UNet pipelines take as
    ``ip_adapter_masks=``) moved to the call's keyword arguments; a key that is one of diffusers' arguments this
    pipeline does not take is refused with :data:`NOT_TAKEN`'s reason, as the keyword itself would be."""
    if not isinstance(value, Mapping):
        return value, kwargs, bound
    names = call_argument_names(cls)
    refused = sorted(k for k in value if k in NOT_TAKEN and k not in names)
    if refused:
        raise InputError(f"{lora} holds {refused[0]!r}: {NOT_TAKEN[refused[0]]}")
    own = sorted(set(value) & (names - {"scale"}))
    if not own:
        return value, kwargs, bound
    twice = [k for k in own if k in kwargs]
    if twice:
        raise InputTypeError(f"{cls.__name__}(...): {twice[0]} given both as an argument and in {lora}; give it once")
    kwargs = {**kwargs, **{k: value[k] for k in own}}
    return {k: v for k, v in value.items() if k not in own}, kwargs, signature.bind(self, *args, **kwargs)


@functools.cache
def call_argument_names(cls: type) -> frozenset[str]:
    """The argument names a pipeline class's calls take: its ``__call__``'s and, through ``**kwargs``, those of the
    ``__call__`` s it inherits (a ControlNet pipeline passes the rest on to its family's call); computed once per
    class (every call checks against it)."""
    names = set()
    for klass in cls.__mro__:
        call = klass.__dict__.get("__call__")
        if call is not None:
            params = list(inspect.signature(call).parameters.values())[1:]
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names)


def is_checked(call) -> bool:
    """Whether ``call`` (a pipeline class's ``__call__``) is wrapped by :func:`checked_call`."""
    return getattr(call, CHECKED, False)
