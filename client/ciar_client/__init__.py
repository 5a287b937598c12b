"""CIAR's device client: what a phone, a laptop or a browser needs to run the CIAR device loop against a cluster,
with no torch and no Ray.

    ciar_client.wire      the device <-> cloud wire format (one codec, shared with the server; numpy only)
    ciar_client.maths     the device's maths on numpy: guidance and sampling, the gates, the interval features
    ciar_client.runtime   the exported device model and VQ decoder on onnxruntime
    ciar_client.connection  a WebSocket `CloudClient` with reconnection and session resumption
    ciar_client.policy    the operating point's cost model and a device's running cost estimates (adaptive CIAR)
    ciar_client.loop      the CIAR device loop

    python -m ciar_client --server ws://localhost:8000 --key ciar-dev-device-key --prompt "..." --out img.png
"""
