"""Test-session setup.

Eight host (CPU) devices, so the sharding tests can build real meshes on any
machine. This must happen before JAX is first imported.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


import pytest  # noqa: E402  (after the XLA flag above)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """amp warns once per primitive per process: each test hears its own.

    amp's caches of rewritten bodies are emptied too: a body served from them
    is not rewritten again, so its warnings would not be said again.
    """
    import weakref

    from jaxamp.transform import _higher_order, _interpreter

    monkeypatch.setattr(_interpreter, "_warned", set())
    monkeypatch.setattr(_interpreter, "_RECOMPUTED", {})
    monkeypatch.setattr(_higher_order, "_AMP_BODIES", weakref.WeakKeyDictionary())
