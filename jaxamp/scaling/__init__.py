"""Loss scaling: the dynamic scaler (`_dynamic_scaler`), the torch-style
`GradScaler`, jmp-style loss scales (`_loss_scale`), their shared schedule,
finiteness decided on every device (`_finite`), the optax wrappers (`_optax`)
and `loss_scaling`, the optax wrapper whose state holds the scale (`_loss_scaling`).

Internal: import the public names from `jaxamp`.
"""
