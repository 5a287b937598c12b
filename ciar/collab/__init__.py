"""CIAR itself, shared by every side: the wire messages (`protocol`, `names`, `knobs`), the device model and its
interval head (`device`, `interval`, `gating`, `projector`), the acceptance rules (`acceptance`), the calibrated
defaults a device file carries (`defaults`) and the accounting (`stats`). docs/architecture.md §3.

The other sides are their own packages: serving in `ciar.engine`, the simulated device in `ciar.sim`, training in
`ciar.training`, the GPU capacity model in `ciar.capacity`.
"""
