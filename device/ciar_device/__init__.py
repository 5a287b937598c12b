"""CIAR's device side and its protocol: what a phone, a laptop or a browser needs to run the CIAR device loop
against a cluster, with no torch and no Ray; the cluster's simulated phones run the same loop, and the server the
same codec.

    ciar_device.wire      the device <-> cloud wire format (one codec, shared with the server; numpy only)
    ciar_device.maths     the device's maths on numpy: guidance and sampling, the gates, the interval features
    ciar_device.runtime   the exported device model and VQ decoder on onnxruntime
    ciar_device.connection  a WebSocket `CloudClient` with reconnection and session resumption
    ciar_device.policy    the operating point's cost model and a device's running cost estimates (adaptive CIAR)
    ciar_device.loop      the device loop (the one Python implementation, every device and method)
    ciar_device.stats     GenerationStats, the accounting every device fills
    ciar_device.history   a session's committed history (resuming a lost session)

    python -m ciar_device --server ws://localhost:8000 --key ciar-dev-device-key --prompt "..." --out img.png
"""
