# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "numpy", "cupy-cuda13x", "jax[cuda13]"]
# ///
"""The forward pass of a MoE layer in JAX on ``ultraep.MoELayer``, balanced by
``ultraep.Balancer``, with every tensor crossing between JAX and the library through DLPack.

    mpirun -n 4 python -m mpi4py examples/jax_moe_forward.py [--steps 3] [--tokens 1024]

JAX computes the router and top-k; the layer takes the JAX tokens, ids and gates as they
are (read-only: the library never writes a JAX buffer), dispatches, runs the BF16 SwiGLU
experts on its grouped GEMM (masters and, with balancing, replica slots) and combines;
its output comes back to JAX zero-copy. The masters are JAX arrays copied into the
layer's stacked weights once (``load_weights``).

Checked: the balanced and unbalanced outputs are bitwise equal (0 differing elements:
the grouped GEMM computes a row the same way wherever its expert runs, and combine adds
each token's top-k results in a fixed order); the busiest rank receives at most 1 % more
rows than the mean with balancing, or one smallest replica's rows (``MIN_REPLICA``) more
where 1 % is fewer. Runs on the GPU or, without one, on JAX's CPU with the
CPU backend.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # four ranks share one GPU

from ultraep.runtime.launch import JobArgumentParser, end_job, positive_int

try:
    import jax
    import jax.numpy as jnp
except ModuleNotFoundError:
    end_job("needs JAX (pip install jax)", "examples/jax_moe_forward.py")
import numpy as np
from mpi4py import MPI

from ultraep import Balancer, EPGroup, ExpertLayout, MoELayer

parser = JobArgumentParser()
parser.add_argument("--steps", type=positive_int, default=3, help="forward steps")
parser.add_argument("--tokens", type=positive_int, default=1024, help="tokens per rank and step")
args = parser.parse_args()

group = EPGroup(MPI.COMM_WORLD)
R, me = group.size, group.rank
jax.config.update("jax_default_matmul_precision", "highest")  # the router in fp32, not TF32
device = jax.devices("gpu")[group.device] if group.has_gpu else jax.devices("cpu")[0]

E, S, H, F, TOP_K, T = 4 * R, 2, 64, 64, 2, args.tokens
MIN_REPLICA = 16  # the fewest rows a replica may take (min_replica_tokens)
layout = ExpertLayout(R, E, S)
M = layout.experts_per_rank


def to_jax(array):
    """A result of the library (CuPy or NumPy) as a JAX array, zero-copy; BF16 crosses as its bits."""
    if array.dtype.name == "bfloat16":
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(array.view(np.int16)), jnp.bfloat16)
    return jax.dlpack.from_dlpack(array)


rng = np.random.default_rng(1000 + me)
w_up = jax.device_put(jnp.asarray(rng.standard_normal((M, H, 2 * F)) / H ** 0.5, dtype=jnp.bfloat16), device)
w_down = jax.device_put(jnp.asarray(rng.standard_normal((M, F, H)) / F ** 0.5, dtype=jnp.bfloat16), device)
router = jax.device_put(np.random.default_rng(7).standard_normal((H, E)).astype(np.float32) / np.float32(H ** 0.5),
                        device)
skew = jnp.zeros(E).at[jnp.array([1, 6])].set(2.5)


@jax.jit
def route(x):
    gates, ids = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ router + skew), TOP_K)
    return gates / gates.sum(axis=-1, keepdims=True), ids


def run(balanced):
    balancer = (Balancer(group, layout, MoELayer.expert_spec(H, F), num_layers=1, min_replica_tokens=MIN_REPLICA)
                if balanced else None)
    layer = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=TOP_K, max_tokens=T, balancer=balancer)
    layer.load_weights(w_up, w_down)
    outputs, rows = [], []
    for step in range(args.steps):
        x = jax.device_put(jnp.asarray(np.random.default_rng((step, me)).standard_normal((T, H)),
                                       dtype=jnp.bfloat16), device)
        gates, ids = route(x)
        y, ctx = layer.forward(x, ids, gates)
        out = to_jax(y)
        outputs.append(np.asarray(jax.lax.bitcast_convert_type(out, jnp.int16)))
        rows.append(group.allgather(ctx.received.num_rows))
    layer.check()
    layer.close()
    if balancer is not None:
        balancer.close()
    return outputs, rows


plain, plain_rows = run(balanced=False)
balanced, rows = run(balanced=True)
differing = sum(group.allgather(sum(int(np.count_nonzero(a != b)) for a, b in zip(balanced, plain))))
worst = max(max(r) * R / sum(r) for r in rows)
bound = max(1.01, 1 + MIN_REPLICA / (T * TOP_K))  # a rank's mean rows: T * TOP_K
if me == 0:
    for step in range(args.steps):
        print(f"step {step}: received rows per rank unbalanced {plain_rows[step]} -> balanced {rows[step]}")
    print(f"busiest rank / mean: unbalanced {max(max(r) * R / sum(r) for r in plain_rows):.4f}, balanced {worst:.4f}; "
          f"{differing} output elements differ")
assert worst <= bound, f"balanced busiest rank is {worst:.4f} x the mean (at most {bound:.4f})"
assert differing == 0, f"{differing} balanced output elements differ from the unbalanced ones"
print(f"rank {me}/{R} ({device.platform}): jax_moe_forward OK", flush=True)
