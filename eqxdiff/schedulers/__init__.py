"""Noise schedulers as pure functions of an explicit state.

>>> sched = scheduler_from_config(raw_scheduler_config)            # or name="euler_a", "unipc", "flow_euler", ...
>>> state = sched.init(25, sample_shape=latents.shape)             # strength=0.6 for img2img
>>> x = noise * sched.init_noise_sigma(state)                      # img2img: sched.add_noise_at_step(state, x0, noise)
>>> def body(_, carry):
...     x, state, key = carry
...     key, sub = jax.random.split(key)
...     out = unet(sched.scale_model_input(state, x), sched.current_timestep(state))
...     x, state = sched.step(state, out, x, key=sub)
...     return x, state, key
>>> x, state, _ = jax.lax.fori_loop(0, sched.remaining_steps(state), body, (x, state, key))

States are arrays only: ``step_index``, ``begin_index`` and ``num_timesteps`` too. ``pad_schedule(state)`` pads the
per-step arrays to a fixed length (:data:`SCHEDULE_BUCKET`), after which schedules of any length and start share
one compiled loop (the pipelines' ``denoise_loop`` does this, and runs ``sched.stepper()``, which drops the config
fields that only shape the schedule, such as a flow shift).

``init`` also takes the keywords of the diffusers scheduler's ``set_timesteps``: ``timesteps=`` / ``sigmas=`` custom
schedules, ``mu=`` (dynamic shifting of flow-matching sigmas; ``dynamic_shift_mu(image_seq_len)``), LCM's
``original_inference_steps=``. Schedulers of the DDPM process (:class:`AbstractBetaScheduler`) also have
``add_noise`` / ``get_velocity`` for training; :class:`FlowMatchEulerDiscreteScheduler` has ``training_schedule``
(what ``eqxdiff.train``'s flow-matching objective samples from) and ``scale_noise``.
"""

from ..core import ConfigError as ConfigError
from ._base import SCHEDULE_BUCKET as SCHEDULE_BUCKET
from ._base import AbstractScheduler as AbstractScheduler
from ._base import AbstractSchedulerState as AbstractSchedulerState
from ._base import AbstractSigmaState as AbstractSigmaState
from ._base import SchedulerConfig as SchedulerConfig
from ._base import SigmaState as SigmaState
from ._base import pad_schedule as pad_schedule
from ._base import schedule_length as schedule_length
from ._base import to_device as to_device
from ._beta import AbstractBetaScheduler as AbstractBetaScheduler
from ._beta import BetaScheduleConfig as BetaScheduleConfig
from ._registry import SCHEDULER_CLASSES as SCHEDULER_CLASSES
from ._registry import SCHEDULERS as SCHEDULERS
from ._registry import SchedulerChoice as SchedulerChoice
from ._registry import scheduler_from_config as scheduler_from_config
from ._sigmas import dynamic_shift_mu as dynamic_shift_mu
from .ddim import DDIMConfig as DDIMConfig
from .ddim import DDIMScheduler as DDIMScheduler
from .ddim import DDIMState as DDIMState
from .ddpm import DDPMConfig as DDPMConfig
from .ddpm import DDPMScheduler as DDPMScheduler
from .ddpm import DDPMState as DDPMState
from .dpm_solver import DPMSolverConfig as DPMSolverConfig
from .dpm_solver import DPMSolverMultistepScheduler as DPMSolverMultistepScheduler
from .dpm_solver import DPMSolverState as DPMSolverState
from .euler import EulerAncestralConfig as EulerAncestralConfig
from .euler import EulerAncestralDiscreteScheduler as EulerAncestralDiscreteScheduler
from .euler import EulerConfig as EulerConfig
from .euler import EulerDiscreteScheduler as EulerDiscreteScheduler
from .flow_match import FlowMatchEulerConfig as FlowMatchEulerConfig
from .flow_match import FlowMatchEulerDiscreteScheduler as FlowMatchEulerDiscreteScheduler
from .lcm import LCMConfig as LCMConfig
from .lcm import LCMScheduler as LCMScheduler
from .lcm import LCMState as LCMState
from .lcm import TCDConfig as TCDConfig
from .lcm import TCDScheduler as TCDScheduler
from .lcm import TCDState as TCDState
from .lms import LMSConfig as LMSConfig
from .lms import LMSDiscreteScheduler as LMSDiscreteScheduler
from .lms import LMSState as LMSState
from .pndm import PNDMConfig as PNDMConfig
from .pndm import PNDMScheduler as PNDMScheduler
from .pndm import PNDMState as PNDMState
from .unipc import UniPCConfig as UniPCConfig
from .unipc import UniPCMultistepScheduler as UniPCMultistepScheduler
from .unipc import UniPCState as UniPCState
