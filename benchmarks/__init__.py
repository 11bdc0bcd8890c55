"""jaxamp's benchmark suite: ``python -m benchmarks.run --help`` from the repository root.

One module per concern (docs/benchmarks.md lists them): what is measured
(`workloads`, `variants`, `models`), how (`measure`, `static_metrics`,
`step_time`, `trace_overhead`, `eager`, `worker`), what it should come to
(`targets`) and how it is reported (`report`, `machine`); `run` is the command
line that ties them together.
"""

import os

# Set before anything imports jax (importing any `benchmarks` module runs this
# first): the process that runs the command line lowers and compiles large
# programs, and must not grab most of a GPU's memory before the step-time
# workers (subprocesses, which inherit the variable) start and measure their
# own peaks. It only takes effect if jax's backend is not initialised yet.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
