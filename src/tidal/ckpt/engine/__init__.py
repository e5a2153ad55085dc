"""The engine: Checkpointer (stage + background persist), staging slots, commit, load, status."""
