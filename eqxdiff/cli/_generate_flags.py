"""``eqxdiff-generate``'s command line: its option groups, the pipeline class the early flags decide (and with it the
family's options), and parsing with every error in one line: a value that does not parse names its flag and what it
takes (:func:`eqxdiff.cli._numbers.number_error`), a short form that disagrees with its long form is refused
(:func:`eqxdiff.cli._options.check_short_forms`). :func:`parse_command` also says which family options the command
line gives, so that the command passes only those on and the folder's recommended call applies to the rest."""

import argparse
import dataclasses
import json
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro
from huggingface_hub import hf_hub_download

from ..core import family_names, resolve_class
from ..loading import CheckpointError, is_hub_id, read_config, read_json, resolve_folder
from ..parallel import MeshConfig
from ..pipelines import DiffusionPipeline, InputError, pipeline_class_for, single_file_class, single_file_components
from ..schedulers import SCHEDULERS
from ._command import DEBUG_HELP, CacheOptions, FlagError, config_errors_raise, python_flag
from ._compose import ControlNetOptions, excluded_arguments, net_class, run_class
from ._lora import LoraOptions
from ._numbers import field_types, number_error
from ._options import ALIASES, FamilyOptions, check_short_forms, family_options, given_options

DEFAULT_MODEL = "digits"
# What the shipped digits model draws when no prompt is given (other models' prompt default is their pipeline's).
DIGITS_PROMPT = "a handwritten digit seven"
Dtype = Literal["float32", "bfloat16", "float16"]
SchedulerName = Literal[tuple(SCHEDULERS)]  # every short name eqxdiff.schedulers.SCHEDULERS knows
# --scheduler's choices as --help shows them: the names (None, its default, keeps the checkpoint's scheduler).
_SCHEDULER_FLAG = tyro.conf.arg(metavar="{" + ",".join(SCHEDULERS) + "}",
                                help_behavior_hint="(default: the checkpoint's own)")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Which pipeline, how it is loaded and run, and where its outputs go."""

    model: str = DEFAULT_MODEL
    """A diffusers pipeline folder, a Hugging Face Hub id, a single .safetensors file (see --config), or ``digits``
    (the small model shipped with eqxdiff). Its pipeline class decides the family options above (``--model X
    --help`` lists X's)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of --model."""
    config: str | None = None
    """With a single .safetensors --model (a Black Forest Labs Flux file, an A1111/ComfyUI checkpoint): a diffusers
    folder or Hub id giving what the file lacks (tokenizers, scheduler, configs, a Flux file's other models)."""
    component: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """With a single .safetensors --model and --config: COMPONENT=FILE reads that pipeline component from another
    single file, as eqxdiff.load_pipeline({component: file}, config=...) does (--model's file fills the component
    its layout names); repeat the flag for several. Wan 2.2 A14B's two experts: --model high_noise.safetensors
    --component transformer_2=low_noise.safetensors --config DIFFUSERS_FOLDER."""
    pipeline_class: str | None = None
    """Run the --model folder as another task of its family, as eqxdiff.load_pipeline(pipeline_class=...) does: a
    Wan 2.2 TI2V-5B folder as WanImageToVideoPipeline (--image), an LTX-Video folder as LTXImageToVideoPipeline or
    LTXConditionPipeline; default: the folder's own class. ``--model X --pipeline-class Y --help`` lists Y's
    options."""
    refiner: str | None = None
    """A refiner pipeline (folder or Hub id, e.g. SDXL's refiner) that finishes the --model base's latents: with
    --denoising-end F the base runs the first F of the schedule and the refiner the rest (ensemble of experts),
    without it the refiner refines the finished latents (its default strength). It gets the base's prompts, steps,
    guidance, seed and scheduler flags; given a mask, it inpaints under the same mask (the refiner folder as its
    family's inpainting pipeline). A ControlNet base hands over text-to-image and inpainting, not image-to-image."""
    unet: str | None = None
    """A UNet in place of the --model pipeline's: a .safetensors file in diffusers' names without a config (a
    distilled UNet: SDXL-Lightning's sdxl_lightning_4step_unet.safetensors, Hyper-SDXL's
    Hyper-SDXL-1step-Unet.safetensors), read into the --model UNet's config, or a UNet folder or Hub id. Give its
    recipe's scheduler flags (Lightning: --scheduler euler --scheduler-option timestep_spacing=trailing)."""
    scheduler: Annotated[SchedulerName | None, _SCHEDULER_FLAG] = None
    """Swap the checkpoint's scheduler by name, keeping its noise schedule and prediction type."""
    scheduler_option: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Set a scheduler config key, KEY=VALUE with VALUE read as JSON (timestep_spacing=trailing,
    use_karras_sigmas=true, steps_offset=1 on the digits model's DPM-Solver++; the options a scheduler has depend
    on its class, --scheduler's included); repeat the flag for several."""
    weights_dtype: Dtype = "float32"
    """Dtype the weights are loaded in."""
    activations_dtype: Dtype = "float32"
    """Dtype of the latents and activations in the denoising loop."""
    attention: str | None = None
    """Attention implementation (xla, chunked, cudnn, flash, ...) of the denoiser, ControlNets and VAE (the text
    and image encoders keep their own); default: chosen for the platform."""
    scan_layers: bool = False
    """Run repeated layers with lax.scan (faster compiles, the same numbers)."""
    offload_encoders: bool = False
    """Keep the text encoders' weights in host memory outside encoding."""
    vae_tiling: bool = False
    """Encode and decode with the VAE in overlapping tiles (bounded memory at large sizes), as diffusers'
    enable_vae_tiling()."""
    textual_inversion: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A textual-inversion embedding for the --model pipeline (SD, SDXL, Flux): a .safetensors file, or a folder or
    Hub id holding learned_embeds.safetensors, with =TOKEN the token prompts use (default: the file's own key; an
    A1111 file needs one: charturner.safetensors=<charturner>); repeat the flag for several."""
    ip_adapter: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """An IP-Adapter for the --model pipeline (SD, SDXL, with --controlnet too), its image prompt --ip-adapter-image:
    a .safetensors file beside its image_encoder folder, or OWNER/NAME/[SUBFOLDER/]FILE.safetensors on the Hub
    (h94/IP-Adapter/models/ip-adapter_sd15.safetensors, whose models/image_encoder is read too); repeat the flag for
    several (the first one's image encoder serves all), each with one --ip-adapter-image, in the same order."""
    ip_adapter_scale: Annotated[tuple[float, ...], tyro.conf.UseAppendAction] = ()
    """The IP-Adapter's strength (diffusers' set_ip_adapter_scale; 0.5-0.7 leaves the prompt more say; default 1);
    with several --ip-adapter, one for all or repeated with one per adapter, in their order."""
    freeu: tuple[float, float, float, float] | None = None
    """FreeU's s1 s2 b1 b2 on the --model pipeline's UNet (SD, SDXL), as diffusers' enable_freeu (SD 1.5: 0.9 0.2
    1.2 1.4; SDXL: 0.6 0.4 1.1 1.2)."""
    output_dir: Path = Path("outputs")
    """Where image_{i}.png / video_{i}.mp4 go (numbered on after the files already there)."""
    overwrite: bool = False
    """Number outputs from 0, replacing earlier files of the same names."""
    fps: float | None = None
    """Frames per second of saved videos; default: the family's frame_rate option if it has one, else the input
    --video's own rate (an upsampled clip plays as it did), else the pipeline's default_fps (the rate its
    checkpoint's videos play at), else 16."""
    debug: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """Show the full traceback of an error instead of its one line (the console command reads it first, anywhere
    on the command line)."""


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """Devices and hosts: the mesh the pipeline runs on and the multi-host settings."""

    parallel: bool = False
    """Run on a device mesh built from the --mesh.* sizes (data parallel over every device by default); implied by
    any --mesh.* flag and by a multi-process run."""
    coordinator_address: str | None = None
    """host:port of process 0 (multi-host; default: EQXDIFF_COORDINATOR)."""
    num_processes: int | None = None
    """Number of processes (hosts) in the run (default: EQXDIFF_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's index, 0 .. num_processes-1 (default: EQXDIFF_PROCESS_ID)."""


def _early_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The flags that decide the pipeline class (and so the other flags): --model, --revision, --config,
    --pipeline-class, and whether --controlnet, --image and --mask are given."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model", default=DEFAULT_MODEL)
    pre.add_argument("--revision", default=None)
    pre.add_argument("--config", default=None)
    pre.add_argument("--pipeline-class", default=None)
    pre.add_argument("--controlnet", action="append", default=[])
    pre.add_argument("--image", default=None)
    pre.add_argument("--mask", "--mask-image", dest="mask", default=None)
    known, _ = pre.parse_known_args(argv)
    return known


def pipeline_class(model: str, revision: str | None = None, config: str | None = None) -> type[DiffusionPipeline]:
    """The eqxdiff pipeline class serving ``model`` (a folder, a Hub id or a shipped name), from its
    ``model_index.json`` alone (a Hub id fetches only that file); a single ``.safetensors`` file's from its tensor
    names (and ``config``'s ``model_index.json``, :func:`eqxdiff.pipelines.single_file_class`)."""
    if Path(model).expanduser().is_file():
        return single_file_class(model, config=config, revision=revision)
    if is_hub_id(model):
        try:
            folder = Path(hf_hub_download(model, "model_index.json", revision=revision)).parent
        except Exception as e:  # network, auth, offline and missing-file errors all end here
            raise CheckpointError(f"could not fetch model_index.json of {model!r} from the Hugging Face Hub "
                                  f"({type(e).__name__}: {e}); pass a local pipeline folder instead") from e
    else:
        folder = resolve_folder(model)
    name = read_config(folder, "model_index.json").get("_class_name")
    cls = resolve_class(name) if isinstance(name, str) else None
    if cls is None or not (isinstance(cls, type) and issubclass(cls, DiffusionPipeline)):
        raise CheckpointError(f"{model!r} holds a {name!r} pipeline (model_index.json _class_name), which eqxdiff "
                              f"does not serve; eqxdiff serves {', '.join(family_names('pipeline'))}")
    return cls


def task_classes(folder_class: type) -> list[type]:
    """The pipeline classes a folder of ``folder_class`` runs as (:func:`eqxdiff.pipelines.pipeline_class_for`):
    its own and its family's other tasks that use the same components, give or take optional ones."""
    found = [folder_class]
    for name in family_names("pipeline"):
        other = resolve_class(name)
        if other in found or not (issubclass(other, folder_class) or issubclass(folder_class, other)):
            continue
        try:
            pipeline_class_for(folder_class, other, where="", holds="")
        except CheckpointError:
            continue
        found.append(other)
    return found


def task_class(folder_class: type, name: str | None) -> type:
    """``--pipeline-class NAME``: the class it names, if a folder of ``folder_class`` runs as it
    (:func:`task_classes`; the folder's own class for ``None``); a :class:`FlagError` naming those it runs as
    otherwise."""
    if name is None:
        return folder_class
    tasks = task_classes(folder_class)
    chosen = next((c for c in tasks if c.__name__ == name), None)
    if chosen is None:
        what = "is no pipeline eqxdiff serves" if name not in family_names("pipeline") else "cannot run it"
        raise FlagError(f"--pipeline-class {name}: {what}; the --model folder's {folder_class.__name__} runs as "
                        f"{', '.join(c.__name__ for c in tasks)}: pass one of those or leave the flag out")
    return chosen


def other_tasks_hint(folder_class: type, cls: type, message: str, read=None) -> str:
    """``message`` (an unrecognized-flags error) with, for each unknown flag that another task of the folder takes
    (``--image`` on a text-to-video folder), the ``--pipeline-class`` that takes it; with ``read`` (the folder's JSON
    files, :func:`config_reader`) only the tasks that drive the folder's models (``runs_folder``)."""
    flags = re.findall(r"(?<![\w-])--([a-z][\w-]*)", message.split(";")[0])
    tasks = [c for c in task_classes(folder_class) if c is not cls and (read is None or _runs(c, read))]
    hints = []
    for flag in dict.fromkeys(flags):
        takers = [c.__name__ for c in tasks if flag.replace("-", "_") in
                  {f.name for f in dataclasses.fields(family_options(c, exclude=excluded_arguments(c)).options)}]
        if takers:
            hints.append(f"--{flag} is an option of {' and '.join(takers)}: add --pipeline-class {takers[0]}"
                         + (" (or another of them)" if len(takers) > 1 else "")
                         + f" to run the --model folder's {folder_class.__name__} as one")
    return message if not hints else f"{message}; {'; '.join(hints)}"


def _runs(cls: type, read) -> bool:
    """``cls.runs_folder(read)`` (a latent pipeline's); True for other classes and when the folder's configs do not
    read (loading will say why)."""
    try:
        return cls.runs_folder(read)
    except Exception:  # noqa: BLE001 - a bad or unfetchable config: the hint is no place to refuse it
        return True


def config_reader(model: str, revision: str | None = None, config: str | None = None):
    """``read(path)``: the JSON file ``path`` of pipeline ``model`` (a folder, a Hub id: that file alone is fetched,
    or a shipped name; for a single file, of its ``config``) as a dict, ``None`` if it has none."""
    if Path(model).expanduser().is_file():
        return (lambda path: None) if config is None else config_reader(config, revision)
    if is_hub_id(model):
        def read(path: str):
            try:
                return read_json(hf_hub_download(model, path, revision=revision))
            except Exception:  # noqa: BLE001 - a missing file, the network: loading says which
                return None
        return read
    folder = resolve_folder(model)
    return lambda path: read_json(folder / path) if (folder / path).is_file() else None


def model_files(run: RunOptions) -> str | dict[str, str]:
    """What ``eqxdiff-generate`` loads: ``--model``, or with ``--component`` flags the mapping ``{component: file}``
    of ``eqxdiff.load_pipeline`` (``--model``'s file under the component its layout names)."""
    if not run.component:
        return run.model
    if run.config is None or not Path(run.model).expanduser().is_file():
        raise InputError("--component goes with a single .safetensors --model and --config (a diffusers folder or Hub "
                         "id of the rest of the pipeline); give both, or leave out --component")
    files: dict[str, str] = {}
    for item in run.component:
        name, sep, file = (part.strip() for part in item.partition("="))
        if not sep or not name or not file:
            raise InputError(f"--component {item!r} must be COMPONENT=FILE, e.g. transformer_2=low_noise.safetensors")
        if name in files:
            raise InputError(f"--component {name}= is given twice; give each component one file")
        files[name] = file
    own = single_file_components(run.model)
    if len(own) != 1:
        raise InputError(f"--model {run.model!r} holds {len(own)} models ({', '.join(own)}); --component goes with a "
                         "--model file of one model")
    if own[0] in files:
        raise InputError(f"--component {own[0]}=... names the component --model's file fills; give the files of the "
                         "other components")
    return {own[0]: run.model, **files}


def scheduler_options(items: Sequence[str]) -> dict[str, Any]:
    """``--scheduler-option KEY=VALUE`` flags as a dict, each value read as JSON (a bare word stays a string)."""
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--scheduler-option {item!r} must be KEY=VALUE, e.g. timestep_spacing=trailing")
        try:
            options[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            options[key.strip()] = text
    return options


def build_parser(family: FamilyOptions) -> type:
    """The dataclass tyro parses: the family's options, the run options, the mesh sizes and the hosts."""
    flat = tyro.conf.OmitArgPrefixes
    return dataclasses.make_dataclass("GenerateArgs", [
        ("pipeline", Annotated[family.options, flat], dataclasses.field(default_factory=family.options)),
        ("run", Annotated[RunOptions, flat], dataclasses.field(default_factory=RunOptions)),
        ("cache", Annotated[CacheOptions, flat], dataclasses.field(default_factory=CacheOptions)),
        ("control", Annotated[ControlNetOptions, flat], dataclasses.field(default_factory=ControlNetOptions)),
        ("lora", Annotated[LoraOptions, flat], dataclasses.field(default_factory=LoraOptions)),
        ("parallel", Annotated[ParallelOptions, flat], dataclasses.field(default_factory=ParallelOptions)),
        ("mesh", MeshConfig, dataclasses.field(default_factory=MeshConfig)),
    ], frozen=True)


def flag_types(family: FamilyOptions) -> dict[str, Any]:
    """``{flag: annotation}`` of every flag of :func:`build_parser`'s command line (short forms and ``--mesh.*``
    included), for :func:`~eqxdiff.cli._numbers.number_error`."""
    types = {python_flag(k): v for k, v in field_types(build_parser(family), dotted=False).items()}
    types |= {"--mesh." + k.replace("_", "-"): v for k, v in field_types(MeshConfig).items()}
    # a repeatable flag takes one value each time it is given
    types |= {(flag := python_flag(name)): typing.get_args(types[flag])[0] for name in family.several}
    return types | {short: types[long] for name, shorts in ALIASES.items() for short in shorts
                    if (long := python_flag(name)) in types}


def recommended_help(folder_class: type[DiffusionPipeline], early: argparse.Namespace) -> str:
    """The help's sentence on the defaults: the ones --help shows are ``__call__``'s signature's, while an option
    left out takes the folder's recommended call first (``model_index.json``'s ``_eqxdiff.call_defaults``: the
    digits model's 20 steps, not the signature's 50), which it lists. A single file carries none (its --config
    folder's are not applied either)."""
    single = Path(early.model).expanduser().is_file()
    recommended = {} if single else folder_class.folder_call_defaults(config_reader(early.model, early.revision))
    listed = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in recommended.items())
    return ("The defaults shown are the pipeline signature's; an option left out takes the --model folder's "
            f"recommended value first ({listed}: model_index.json's _eqxdiff.call_defaults). " if recommended else
            "The defaults shown are the pipeline signature's (the --model "
            f"{'file carries' if single else 'folder recommends'} no values of its own). ")


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A parsed command line: the options of the pipeline class it runs, the parsed flags, the ``--model`` folder's
    own class, and the family options it gives (by flag, or the command's own default: the digits prompt)."""

    family: FamilyOptions
    args: Any
    folder_class: type
    given: frozenset[str]


def parse_command(argv: Sequence[str], *, prog: str | None = None) -> Parsed:
    """Parse ``argv`` (the cache flags included, ``--debug`` too) for the pipeline class it runs (the ``--model``
    folder's, or its ControlNet pipeline: :func:`eqxdiff.cli._compose.run_class`); every refusal is a
    :class:`~eqxdiff.cli._command.FlagError` or the error of the config the flags build, in one line."""
    argv = list(argv)
    check_short_forms(argv)
    early = _early_flags(argv)
    folder_class = pipeline_class(early.model, early.revision, early.config)
    task = task_class(folder_class, early.pipeline_class)
    cls = run_class(task, controlnet=bool(early.controlnet), image=early.image is not None,
                    mask=early.mask is not None, net=net_class(early.controlnet, config_reader))
    own = {"prompt": DIGITS_PROMPT} if early.model == DEFAULT_MODEL else {}
    family = family_options(cls, own, exclude=excluded_arguments(cls))
    what = ("the --model folder's class" if cls is folder_class else
            f"the --model folder's {folder_class.__name__} as --pipeline-class" if cls is task else
            f"the --model folder's {folder_class.__name__} with ControlNet" if early.controlnet else
            f"the --model folder's {folder_class.__name__} for --image")
    description = (f"Images or videos from a diffusion pipeline. The pipeline options are {cls.__name__}'s ({what}); "
                   f"eqxdiff serves {', '.join(family_names('pipeline'))}. "
                   f"{recommended_help(folder_class, early)}"
                   f"{DEBUG_HELP}")
    try:
        with config_errors_raise():
            args = tyro.cli(build_parser(family), args=argv, prog=prog, description=description)
    except FlagError as e:
        if str(e).startswith("unrecognized argument"):
            read = config_reader(early.model, early.revision, early.config)
            raise FlagError(other_tasks_hint(folder_class, cls, str(e), read)) from None
        raise
    except ValueError as e:  # a number that does not parse: in the flag's words (tyro's names neither)
        message = number_error(argv, flag_types(family))
        raise (FlagError(message) if message else e) from None
    return Parsed(family, args, folder_class, frozenset(given_options(argv, family.options) | set(own)))
