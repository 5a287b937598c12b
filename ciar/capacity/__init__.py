"""The GPU capacity model (docs/architecture.md §11): recorded phone sessions (`trace.SessionTrace`) replayed in
simulated time against a modelled replica that runs the engine's own scheduler (`gpu_model`).
"""
