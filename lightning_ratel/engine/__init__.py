"""The step coordinator and what it coordinates: the model's layout and blocks, materialization, the block schedule,
planning, the step protocol, byte accounting, and the user's reads and writes between steps.

:class:`~lightning_ratel.engine.coordinator.RatelEngine` drives :mod:`lightning_ratel.runtime` and
:mod:`lightning_ratel.io` for the Lightning adapters; nothing here moves data itself.
"""
