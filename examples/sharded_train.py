"""FSDP-style training of a small MLP in bf16 mixed precision on 8 host devices.

Every weight matrix and its Adam moments are split over the "fsdp" mesh axis (each
device stores 1/8 of them), the batch is split over ("dp", "fsdp"), and
`jaxamp.amp` runs the loss in bfloat16 while the parameters stay float32.

    python examples/sharded_train.py

On CPU the script fakes 8 devices with XLA_FLAGS; on a machine with accelerators
it uses whatever devices JAX sees (the batch must divide by their count).
"""

import os

# Must happen before JAX is imported: the flag is read when the CPU backend starts.
_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402
from jaxamp.sharding import (  # noqa: E402
    create_mesh,
    get_weight_decay_mask,
    make_shard_and_gather_fns,
    match_partition_rules,
    tree_apply,
    with_sharding_constraint,
)

IN_DIM, HIDDEN, CLASSES, DEPTH = 32, 256, 8, 3
BATCH, STEPS, LEARNING_RATE = 256, 30, 3e-3

# First match wins; anchoring with "$" lets the same rules fit the Adam moments,
# whose paths read "0/mu/layers/0/w".
PARTITION_RULES = (
    (r"layers/\d+/w$", P("fsdp", "tp")),
    (r"head/w$", P("fsdp", None)),
    (r"/b$", P()),  # biases are tiny: replicate
    (r".*", P()),
)
BATCH_SPEC = P(("dp", "fsdp"))  # data parallel over every device


def init_params(seed):
    """Host (numpy) parameters: nothing is allocated on devices until sharded."""
    rng = np.random.default_rng(seed)
    dims = [IN_DIM] + [HIDDEN] * DEPTH

    def dense(fan_in, fan_out):
        return {
            "w": rng.normal(0.0, fan_in**-0.5, (fan_in, fan_out)).astype(np.float32),
            "b": np.zeros((fan_out,), np.float32),
        }

    return {
        "layers": [dense(a, b) for a, b in zip(dims[:-1], dims[1:])],
        "head": dense(HIDDEN, CLASSES),
    }


def loss_fn(params, x, labels):
    h = x
    for layer in params["layers"]:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        # Keep activations batch-sharded; the compiler then all-gathers each
        # weight just in time, which is what makes this FSDP.
        h = with_sharding_constraint(h, P(("dp", "fsdp"), None))
    logits = h @ params["head"]["w"] + params["head"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def synthetic_batches(seed):
    """Labels from a fixed random linear teacher, so the loss can go down."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(IN_DIM, CLASSES)).astype(np.float32)
    while True:
        x = rng.normal(size=(BATCH, IN_DIM)).astype(np.float32)
        yield x, np.argmax(x @ teacher, axis=-1).astype(np.int32)


def main():
    mesh = create_mesh((1, -1, 1, 1), ("dp", "fsdp", "tp", "sp"))
    print(f"mesh: {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices")

    def shardings(specs):
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)

    host_params = init_params(seed=0)
    param_specs = match_partition_rules(PARTITION_RULES, host_params)
    # float32 master weights; amp casts to bf16 inside the loss only.
    shard_fns, gather_fns = make_shard_and_gather_fns(param_specs, jnp.float32)

    optimizer = optax.adamw(LEARNING_RATE, weight_decay=1e-4, mask=get_weight_decay_mask([r"/b$"]))
    # Specs for the optimizer state come from its shapes alone, so init can write
    # each moment straight into its shards.
    opt_specs = match_partition_rules(PARTITION_RULES, jax.eval_shape(optimizer.init, host_params))
    param_shardings, opt_shardings = shardings(param_specs), shardings(opt_specs)
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    replicated = NamedSharding(mesh, P())

    amp_loss = jaxamp.amp(loss_fn, compute_dtype="bf16")

    def train_step(params, opt_state, x, labels):
        loss, grads = jax.value_and_grad(amp_loss)(params, x, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(
        train_step,
        in_shardings=(param_shardings, opt_shardings, batch_sharding, batch_sharding),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )

    with jax.set_mesh(mesh):
        params = tree_apply(shard_fns, host_params)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        batches = synthetic_batches(seed=1)
        start = time.perf_counter()
        for step in range(1, STEPS + 1):
            x, labels = next(batches)
            x = jax.device_put(x, batch_sharding)
            labels = jax.device_put(labels, batch_sharding)
            params, opt_state, loss = train_step(params, opt_state, x, labels)
            print(f"step {step:3d}  loss {float(loss):.4f}")
        print(f"{STEPS} steps in {time.perf_counter() - start:.1f}s (including compilation)")

    w0 = params["layers"][0]["w"]
    print(
        f"layers/0/w      {w0.dtype} {w0.shape} sharding {w0.sharding.spec}, "
        f"per-device block {w0.addressable_shards[0].data.shape}"
    )
    print(f"head/w          sharding {params['head']['w'].sharding.spec}")
    print(f"adam mu layers/0/w sharding {opt_state[0].mu['layers'][0]['w'].sharding.spec}")
    host = tree_apply(gather_fns, params)
    print(
        f"gathered layers/0/w: {type(host['layers'][0]['w']).__name__} "
        f"{host['layers'][0]['w'].dtype} {host['layers'][0]['w'].shape}"
    )


if __name__ == "__main__":
    main()
