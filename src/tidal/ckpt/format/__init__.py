"""The checkpoint format: boxes and tiling, save plans, the manifest, flattening a state (pure)."""
