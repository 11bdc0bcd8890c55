"""Loss scaling: the dynamic scaler (`_dynamic_scaler`), the torch-style
`GradScaler`, jmp-style loss scales (`_loss_scale`), their shared schedule,
finiteness decided on every device (`_finite`) and the optax wrappers (`_optax`).

Internal: import the public names from `jaxamp`.
"""
