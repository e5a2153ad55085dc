"""``tidal demo``: the platform end to end on this machine, a face like the CLI (it drives an embedded
control plane through the public API): ``single`` (a job loses a rank and recovers), ``cycle`` (a day
of lending serving GPUs), ``on_ray`` (a job across Ray nodes loses a node), ``ray_cycle`` (the day of
lending on a local Ray cluster, a node lost at night); ``plane`` is the embedded plane they share,
``options`` the GPT example they train (and ``tidal demo``'s options), ``ray_cluster`` the local Ray
cluster of the two Ray demos."""
