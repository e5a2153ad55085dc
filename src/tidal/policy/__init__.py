"""Pure decision functions, shared by the live control plane and the simulator.

No I/O, no clock reads (time is an argument, in seconds), no unseeded randomness. Inputs and outputs
are frozen dataclasses and numpy arrays; policies that learn take a state and return the next one
(``policy(ctx, state) -> (decision, new_state)``), so a caller can step and persist them. See
docs/architecture.md for the modules.
"""
