"""Where arrays live on a mesh.

``Parallelism`` names the mesh axes that play data, fsdp, sequence and tensor and maps
the models' logical dimension names onto them (``parallelism``); ``choose_mesh`` picks
the sizes of those roles for a model and a cluster (``choose_mesh``); ``specs`` holds
attention's specs on N-D meshes and the GQA head split; ``fsdp`` the one-axis layout of
fully sharded parameters and optimizer state.
"""

from jax_seqpar.sharding.choose_mesh import MeshChoice, choose_mesh
from jax_seqpar.sharding.fsdp import (bytes_per_device, fsdp_shardings, fsdp_spec,
                                      replicated_shardings)
from jax_seqpar.sharding.parallelism import (ROLES, Parallelism, make_mesh,
                                             parse_mesh_arg)
from jax_seqpar.sharding.specs import activation_spec, kv_head_repeats

__all__ = ["MeshChoice", "Parallelism", "ROLES", "activation_spec", "bytes_per_device",
           "choose_mesh", "fsdp_shardings", "fsdp_spec", "kv_head_repeats", "make_mesh",
           "parse_mesh_arg", "replicated_shardings"]
