"""The simulated device (docs/architecture.md §4): the device loop wired to the torch device model, a simulated
network link and a cloud client (`decoder.CollabDecoder`, the method presets `decoder.method_config`), the network
model (`network`), the client side of session recovery (`recovery.RecoveringClient`) and the builders of a decoder
and a verifier for a world (`runtime`).
"""
