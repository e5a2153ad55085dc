"""``tidal demo``: the platform end to end on this machine, a face like the CLI driving an embedded
control plane through the public API: ``single``, ``cycle``, ``on_ray`` and ``ray_cycle``."""
