"""eqxdiff.parallel: device mesh, logical-axis sharding rules, activation constraints, remat and jit helpers.

>>> mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
>>> unet = eqxdiff.load(folder, "unet", sharding=sharding_fn(mesh))   # each device reads its own slices
>>> unet = with_plan(unet, Plan(mesh, remat=Remat.FULL))             # activation constraints + remat
"""

from ..core import DEFAULT_RULES as DEFAULT_RULES
from ..core import AxisRules as AxisRules
from ..core import Plan as Plan
from ..core import Remat as Remat
from ..core import activation_sharding as activation_sharding
from ..core import checkpoint_block as checkpoint_block
from ..core import checkpoint_names as checkpoint_names
from ..core import constrain as constrain
from ..core import logical_to_spec as logical_to_spec
from ..core import remat_policy as remat_policy
from ..core import with_plan as with_plan
from ._mesh import MESH_AXES as MESH_AXES
from ._mesh import MeshConfig as MeshConfig
from ._mesh import MeshError as MeshError
from ._mesh import initialize_distributed as initialize_distributed
from ._mesh import make_mesh as make_mesh
from ._params import param_shardings as param_shardings
from ._params import param_spec as param_spec
from ._params import shard_params as shard_params
from ._params import sharding_fn as sharding_fn
from ._run import batch_sharding as batch_sharding
from ._run import batch_shards as batch_shards
from ._run import global_batch_size as global_batch_size
from ._run import host_local_batch as host_local_batch
from ._run import per_device_bytes as per_device_bytes
from ._run import shard_batch as shard_batch
from ._run import sharded_jit as sharded_jit
