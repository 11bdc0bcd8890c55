"""The live loss scale of one `loss_scaling` transformation, readable in whatever traces the loss.

``amp(loss, loss_scale=opt_state)`` needs the optimizer state inside the
function that takes the gradient. Where a framework owns that function (Tunix's
trainers, MaxText's ``train_step``) the user cannot pass it: the state exists
only inside the framework's jitted step. So the transformation itself carries
its scale in `jax.Ref` cells (JAX lifts refs a jitted function closes over into
its inputs and outputs): ``amp(loss, loss_scale=tx)`` reads the scale from
them, the transformation's update writes the next one. The state stays the
record (checkpoints restore it; the update steers by it); the cells follow it.

amp's backward pass, given a live scale, hands the overflow back in the
gradients, NaN throughout a value that overflowed, as it does given the state:
the update skips what it is handed, so a gradient discarded, handed to two
updates or jitted apart from the update carries its own verdict. It also notes
the scale it ran at, so the update knows a step that ran at another scale than
its state's (the first after a restore or a rollback, or a state this
transformation's cells did not follow): an overflow above the state's scale
says nothing of it, and leaves it as it was.

Where an optax wrapper that cannot take a NaN holds the transformation
(``optax.MultiSteps``, which Tunix puts around the user's optimizer, resets its
accumulator by multiplying it by 0; ``apply_if_finite`` would keep the scale
from shrinking), its init tells the cells so, and the backward pass hands back
zeros and sets a flag the update reads instead. The update skips a step whose
flag was set since the last update that was committed for the same model, so
inside ``MultiSteps`` (whose wrapped update runs at every micro-batch, its
state kept only at the real step) one overflowing micro-batch skips the real
step. It knows a committed update from a discarded one by the state it is
handed: the one its last call for that model produced (committed) or an older
one (discarded); and a model by its gradients' structure and a checksum of
its parameters (`model_identity`), so a transformation serving several keeps
each one's overflows apart.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from ._finite import is_inexact_leaf

__all__ = ["LiveScale", "ModelIdentity", "find_live_scale", "model_identity", "replicated_like"]


class LiveScale:
    """The cells of one `loss_scaling` transformation: its scale, amp's overflow flag, the last state it made.

    Attributes:
        attached: whether amp was given this transformation (``loss_scale=tx``):
            only then does the update read and write the cells, so a
            transformation used with ``loss_scale=opt_state`` adds no
            side effect to the step (nor a closed-over ref inside ``pmap``).
    """

    def __init__(self, initial_scale: Any):
        self.initial_scale = None if initial_scale is None else float(initial_scale)
        self.attached = False
        # An optax wrapper that cannot take a NaN gradient holds the
        # transformation (its init said so): the overflow travels by the flag.
        self.zeros_on_overflow = False
        self._warned_foreign = False
        self._traced = False  # a trace has closed over the cells: they stay where they are
        # A restored state's scale, count and resets (`follow`): the cells start from them.
        self._followed: dict[str, Any] = {}
        # Made at first need, not here: an optimizer built before
        # `jax.distributed.initialize` (a driver's import-time patch) must not
        # start JAX's backends.
        self._cells: dict[str, Any] | None = None

    def _initial_values(self) -> dict[str, np.ndarray]:
        return {
            "scale": np.float32(self.initial_scale),
            # the scale amp's last backward pass ran at; -1: none yet.
            "ran_at": np.float32(-1.0),
            # a wrapper that cannot take a NaN holds the transformation: amp hands back zeros and the flag.
            "zeros_on_overflow": np.bool_(False),
            # amp's backward passes since the last update overflowed (the updates after them read it).
            "overflow": np.bool_(False),
            # an update ran since amp's last backward pass: the next one starts the flag anew.
            "after_update": np.bool_(True),
            # what the last update produced (scale, count, total_resets); -1: none yet.
            "last_scale": np.float32(-1.0),
            "last_count": np.int32(-1),
            "last_resets": np.int32(-1),
            # Inside MultiSteps, a slot per model (`model_identity`; structure -1: free) updated lately:
            # what its last update produced, and its window: an overflow since its
            # last committed update, and whether at a stale scale (it says nothing of the state's).
            "slot_structure": np.full(_SLOTS, -1, np.int32),
            "slot_checksum": np.zeros(_SLOTS, np.int32),
            "slot_scale": np.full(_SLOTS, -1.0, np.float32),
            "slot_count": np.full(_SLOTS, -1, np.int32),
            "slot_resets": np.full(_SLOTS, -1, np.int32),
            "slot_window": np.zeros(_SLOTS, np.bool_),
            "slot_window_stale": np.zeros(_SLOTS, np.bool_),
            # the slot a model without one takes next (the least lately taken).
            "slot_next": np.int32(0),
        } | self._followed

    def _make(self, sharding: Any) -> dict[str, Any]:
        def cell(value: Any) -> Any:
            value = np.asarray(value)
            return jax.new_ref(value if sharding is None else jax.device_put(value, sharding))

        return {name: cell(value) for name, value in self._initial_values().items()}

    def place_like(self, params: Any) -> None:
        """Reset the cells to the initial scale, replicated over the mesh `params` live on (eagerly, at init).

        A jitted step over a mesh takes its closed-over refs on that mesh; a
        ref on one device would not be. Cells already there are written in
        place, not replaced: a gradient function traced before this init (a
        reset, a second run in the process) closes over them, and must mark
        the cells this transformation's update reads.
        """
        if self.initial_scale is None or _compat.staging() or _compat.mapped():
            return  # traced params (an init under jit or vmap) leave the cells as they are
        self._followed = {}  # a fresh state: the initial scale
        sharding = replicated_like(params)
        if self._cells is not None and _devices(self._cells) == _devices_of(sharding):
            for name, value in self._initial_values().items():
                self._cells[name][...] = jax.device_put(value, self._cells[name].sharding)
            return
        self._cells = self._make(sharding)
        self._traced = False  # new cells: no compiled step holds these

    def follow(self, scale: Any, count: Any, resets: Any) -> None:
        """A state restored from a checkpoint (eagerly): amp's next step runs at its scale, the update steers by it.

        As if this transformation's last update had made it: the first step
        after a restore runs at the restored scale, not the initial one.
        """
        if self.initial_scale is None or _compat.staging():
            return
        self._followed = {
            "scale": np.float32(scale),
            "last_scale": np.float32(scale),
            "last_count": np.int32(count),
            "last_resets": np.int32(resets),
            # What holds the transformation did not change with the state: MultiSteps' zeros stay
            # (and are set where its init was only traced, for the restore target's shape).
            "zeros_on_overflow": np.bool_(self.zeros_on_overflow),
        }
        if self._cells is not None:
            for name, value in self._initial_values().items():
                self._cells[name][...] = jax.device_put(value, self._cells[name].sharding)

    def cells(self) -> dict[str, Any]:
        """The cells, made at first need; inside a trace, on the devices of the mesh it runs under."""
        self._check_initial()
        staging = _compat.staging()
        if self._cells is None:
            mesh = _compat.context_mesh() if staging else None
            with _compat.outside_traces():
                self._cells = self._make(None if mesh is None else _replicated(mesh))
        elif staging:
            self._follow_mesh()
        if staging:
            self._traced = True
        return self._cells

    def _check_initial(self) -> None:
        if self.initial_scale is None:
            raise ValueError(
                "amp's loss_scale is a jaxamp.loss_scaling transformation made inside a traced function "
                "(under jax.jit) or with a traced initial scale: its live scale needs its initial scale "
                "as a number. Build the optimizer outside the jitted step, or pass the optimizer "
                "state: loss_scale=opt_state."
            )

    def _follow_mesh(self) -> None:
        """Remake the cells on the context mesh's devices where they are elsewhere and no trace holds them yet.

        An optimizer whose init ran under `jax.jit` (MaxText's) left them where
        they were made, on one device, which a step over a mesh refuses.
        """
        mesh = _compat.context_mesh()
        assert self._cells is not None
        devices = _devices(self._cells)
        if mesh is None or devices == set(mesh.devices.flat):
            return
        if self._traced:
            raise ValueError(
                f"jaxamp.loss_scaling's live scale is on devices {sorted(d.id for d in devices)}, and a "
                f"compiled step already holds it there, but this step runs over a mesh of "
                f"{mesh.devices.size} devices. Call the optimizer's init outside jax.jit with the "
                "parameters placed on the mesh, or give amp the optimizer state (loss_scale=opt_state)."
            )
        with _compat.outside_traces():
            self._cells = self._make(_replicated(mesh))

    def attach(self) -> None:
        """amp was given this transformation: from now on its update reads and writes the cells."""
        self._check_initial()
        self.attached = True

    def read_scale(self) -> jax.Array:
        """The scale, as a value of the program being traced (float32 scalar)."""
        if _compat.manual_axes():
            raise ValueError(
                "amp's loss_scale is a jaxamp.loss_scaling transformation (a live scale) inside a "
                "shard_map or pmap body, which cannot close over its cells. Pass the optimizer state "
                "into the mapped function instead: jaxamp.amp(loss, compute_dtype='f16', loss_scale=opt_state)."
            )
        return self.cells()["scale"][...]

    def wrapped_by_nan_intolerant(self) -> None:
        """The transformation's init was called by a wrapper that cannot take a NaN gradient: overflows leave zeros."""
        self.zeros_on_overflow = True
        if not _compat.mapped():
            # A gradient function traced before this init reads the cell when it runs.
            self.cells()["zeros_on_overflow"][...] = jnp.array(True)

    def note_backward(self, scale: jax.Array, finite: jax.Array) -> jax.Array:
        """amp's backward pass ran at `scale`, finite or not; the value an overflowed cotangent takes (0 or NaN).

        The flag holds the backward passes since the last update (several, where
        a step accumulates micro-batches before one update) and stays set for
        every update until the next backward pass: each update handed the
        same gradients skips them.
        """
        c = self.cells()
        c["ran_at"][...] = scale
        restart = c["after_update"][...]
        c["overflow"][...] = jnp.where(restart, ~finite, c["overflow"][...] | ~finite)
        c["after_update"][...] = jnp.array(False)
        return jnp.where(c["zeros_on_overflow"][...], 0.0, jnp.nan)

    def ran_above(self, scaler_state: Any) -> jax.Array:
        """Whether the gradients were taken at a scale above `scaler_state`'s, which is not the cells' to follow.

        An overflow there says nothing of the state's scale. The cells follow
        the state this transformation's last update made (handed again, with
        the same gradients or the next ones, it steers as the state path
        would); any other is the first after a restore (the cells hold the
        initial scale) or, where the cells followed a state before, a
        rollback or a second state: said once.
        """
        c = self.cells()
        ran_at, own = self._ran_at(), jnp.asarray(scaler_state.scaler, jnp.float32)
        first = c["last_scale"][...] < 0
        followed = first | self._is_last(scaler_state)
        foreign = ~followed & (ran_at != own)
        self._say_if_foreign(foreign, ran_at, own)
        return (first | foreign) & (ran_at > own)

    def _ran_at(self) -> jax.Array:
        """The scale amp's last backward pass ran at (the cells' scale where none ran yet)."""
        c = self.cells()
        return jnp.where(c["ran_at"][...] < 0, c["scale"][...], c["ran_at"][...])

    def _say_if_foreign(self, foreign: jax.Array, ran_at: jax.Array, own: jax.Array) -> None:
        """Warn once, when the step runs, where `foreign`: the update was handed a state the cells did not follow."""
        jax.lax.cond(foreign, lambda: jax.debug.callback(self._warn_foreign, ran_at, own), lambda: None)

    def _is_last(self, scaler_state: Any) -> jax.Array:
        """Whether `scaler_state` is the one this transformation's last update made (scale, count and resets)."""
        c = self.cells()
        return _same_state(scaler_state, (c["last_scale"][...], c["last_count"][...], c["last_resets"][...]))

    def _warn_foreign(self, ran_at: Any, own: Any) -> None:
        if self._warned_foreign:
            return
        self._warned_foreign = True
        warnings.warn(
            "jaxamp.loss_scaling's live scale follows the optimizer state its update made last, but the "
            f"update was handed another (amp's backward pass ran at {float(ran_at):g}, the state holds the "
            f"scale {float(own):g}): the state was rolled back to an earlier copy, or this transformation "
            "serves more than one optimizer state. amp reads the "
            "scale of whichever state this transformation updated last, so such a state's steps run at "
            "another's scale (an overflow above its own is skipped and leaves its scale as it was). "
            "Build one jaxamp.loss_scaling per optimizer state, or give amp the state: "
            "jaxamp.amp(loss, compute_dtype='f16', loss_scale=opt_state).",
            UserWarning,
            stacklevel=2,
        )

    def overflow_since_commit(self, scaler_state: Any, model: ModelIdentity) -> tuple[jax.Array, jax.Array]:
        """Whether amp overflowed since `model`'s last update whose result was kept, and whether at a stale scale.

        `scaler_state` is the state the update is handed, `model` what it is
        handed it for (`model_identity`). Each model's window is its own: the
        last call for it was kept where it made this state; otherwise it was
        dropped (inside ``MultiSteps`` a micro-batch's update is, until the
        real step), and the window carries on. A model the slots do not hold
        (its first update, or its first micro-batch since the parameters moved)
        has nothing to carry. A state the cells did not follow (another model's,
        or one rolled back) is said once, as `ran_above` says it. A repeated
        value (a call that changed none of scale, count and resets) leaves the
        window as it was, which was empty: such a call saw no overflow.

        Stale: this is the cells' first update and the scale amp read is not
        the state's, as on the first step after a checkpoint restored the
        state, or the only overflow is one carried from such a step (inside
        ``MultiSteps``, to its real step). An overflow there says nothing of
        the state's scale.
        """
        c = self.cells()
        own = jnp.asarray(scaler_state.scaler, jnp.float32)
        found, slot = self._slot_of(model)
        made = (c["slot_scale"][...][slot], c["slot_count"][...][slot], c["slot_resets"][...][slot])
        carried = found & ~_same_state(scaler_state, made) & c["slot_window"][...][slot]
        first = c["last_scale"][...] < 0
        foreign = ~first & ~found & ~self._is_last(scaler_state)
        self._say_if_foreign(foreign, self._ran_at(), own)
        fresh = c["overflow"][...]
        read_stale = first & (c["scale"][...] != own)
        stale = read_stale | (carried & c["slot_window_stale"][...][slot] & ~fresh)
        return carried | fresh, stale

    def _slot_of(self, model: ModelIdentity) -> tuple[jax.Array, jax.Array]:
        """Whether a slot holds `model`, and that slot (else the one it takes)."""
        c = self.cells()
        structure, checksum = model
        matches = c["slot_structure"][...] == structure
        if checksum is not None:
            matches &= c["slot_checksum"][...] == checksum
        found = jnp.any(matches)
        return found, jnp.where(found, jnp.argmax(matches), c["slot_next"][...]).astype(jnp.int32)

    def commit(self, overflow: jax.Array, stale: jax.Array, scaler_state: Any, model: ModelIdentity | None) -> None:
        """The update's end: the state it made, the scale amp reads next, and `model`'s window (stale or not).

        `model` is what the update was handed the state for (`model_identity`),
        where the window is kept (inside ``MultiSteps``); None elsewhere.
        """
        c = self.cells()
        made = _summary(scaler_state)
        if model is not None:
            found, slot = self._slot_of(model)
            structure, checksum = model
            checksum = jnp.int32(0) if checksum is None else checksum
            for name, value in (
                ("slot_structure", jnp.int32(structure)),
                ("slot_checksum", checksum),
                ("slot_scale", made[0]),
                ("slot_count", made[1]),
                ("slot_resets", made[2]),
                ("slot_window", overflow),
                ("slot_window_stale", overflow & stale),
            ):
                c[name][...] = c[name][...].at[slot].set(value)
            c["slot_next"][...] = jnp.where(found, c["slot_next"][...], (slot + 1) % _SLOTS).astype(jnp.int32)
        c["after_update"][...] = jnp.array(True)
        c["last_scale"][...], c["last_count"][...], c["last_resets"][...] = made
        c["scale"][...] = made[0]


def _summary(scaler_state: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`scaler_state`'s scale, count and resets, in the cells' dtypes."""
    return (
        jnp.asarray(scaler_state.scaler, jnp.float32),
        jnp.asarray(scaler_state.count, jnp.int32),
        jnp.asarray(scaler_state.total_resets, jnp.int32),
    )


def _same_state(scaler_state: Any, made: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """Whether `scaler_state` holds the scale, count and resets `made` (an update's result)."""
    return jnp.all(jnp.stack([a == b for a, b in zip(_summary(scaler_state), made)]))


# How many models one transformation keeps a window for, inside MultiSteps:
# those whose micro-batches interleave within a real step.
_SLOTS = 4

# What an update is handed an optimizer state for: its gradients' structure (a
# number, the same in every process) and a checksum of its parameters (None: none given).
ModelIdentity = tuple[int, Any]


def model_identity(grads: Any, params: Any) -> ModelIdentity:
    """What tells one model's updates from another's: `grads`' structure, and a checksum of `params`.

    The structure tells models of different shapes apart; the checksum, the
    bits of each parameter's first row summed (left as they were by
    ``MultiSteps``' micro-batches), models of one shape. Integers, wrapping:
    the sum is the same whatever order a program adds them in (a GPU's
    reduction may use atomics), and a zero's sign (which adding a zero update
    can flip) does not count. A row, not the whole parameter: XLA's CPU
    backend sums integers about ten times slower than floats (all of a
    16.8M-parameter model's bits took as long as its Adam update, 60 ms).
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    shapes = [(jnp.shape(x), str(jnp.result_type(x))) for x in leaves if is_inexact_leaf(x)]
    structure = zlib.crc32(f"{treedef}{shapes}".encode()) & 0x7FFFFFFF
    floating = [x for x in jax.tree_util.tree_leaves(params) if is_inexact_leaf(x) and not jnp.iscomplexobj(x)]
    sums = [_bits_sum(x) for x in floating]
    return structure, (jnp.sum(jnp.stack(sums), dtype=jnp.int32) if sums else None)


def _bits_sum(x: Any) -> jax.Array:
    """The bits of `x`'s first row (along its last axis) as float32, a zero's sign dropped, summed as int32."""
    row = jnp.asarray(x[(0,) * (jnp.ndim(x) - 1)] if jnp.ndim(x) > 1 else x, jnp.float32)
    return jnp.sum(jax.lax.bitcast_convert_type(jnp.where(row == 0, 0.0, row), jnp.int32), dtype=jnp.int32)


def _replicated(mesh: Any) -> Any:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def replicated_like(tree: Any) -> Any:
    """A sharding replicated over the mesh of `tree`'s first leaf on a mesh (arrays or abstract), else None."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return _replicated(sharding.mesh)
    return None


def _devices(cells: dict[str, Any]) -> set[Any]:
    """The devices the cells live on (the ref's sharding: reading its value there would need them here)."""
    return set(cells["scale"].sharding.device_set)


def _devices_of(sharding: Any) -> set[Any]:
    """The devices of `sharding`; None (no mesh): the default device, where unplaced cells are made."""
    return set(sharding.device_set) if sharding is not None else {jax.devices()[0]}


# How deep `find_live_scale` looks through closures and wrappers.
_DEPTH = 6


def find_live_scale(obj: Any) -> LiveScale | None:
    """The `LiveScale` of the one `loss_scaling` transformation `obj` holds, else None.

    `obj` is the transformation, one that wraps it (``optax.chain``,
    ``optax.MultiSteps``, ``inject_hyperparams``), an ``nnx.Optimizer`` (its
    ``tx``) or an object holding one as ``optimizer`` (a Tunix trainer).

    Raises:
        ValueError: `obj` holds more than one.
    """
    found: list[LiveScale] = []
    seen: set[int] = set()

    def visit(x: Any, depth: int) -> None:
        if depth > _DEPTH or id(x) in seen or x is None:
            return
        seen.add(id(x))
        live = getattr(x, "_jaxamp_live_scale", None)
        if isinstance(live, LiveScale):
            if all(live is not f for f in found):
                found.append(live)
            return
        if isinstance(x, tuple) and hasattr(x, "update") and hasattr(x, "init"):  # a GradientTransformation
            visit(x.update, depth + 1)
            visit(x.init, depth + 1)
        elif callable(x) and hasattr(x, "__self__"):  # a bound method (MultiSteps.update)
            visit(x.__self__, depth + 1)
        elif hasattr(x, "__closure__") and x.__closure__:
            for c in x.__closure__:
                try:
                    visit(c.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(x, (tuple, list)):
            for item in x:
                visit(item, depth + 1)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item, depth + 1)
        else:
            for name in ("_opt", "tx", "optimizer", "inner"):
                child = getattr(x, name, None) if not isinstance(x, (int, float, str, bytes)) else None
                if child is not None:
                    visit(child, depth + 1)

    visit(obj, 0)
    if len(found) > 1:
        raise ValueError(
            f"amp's loss_scale holds {len(found)} jaxamp.loss_scaling transformations: amp cannot tell "
            "which one's scale the loss is scaled by. Wrap one optimizer in jaxamp.loss_scaling and "
            "give amp that one."
        )
    return found[0] if found else None
