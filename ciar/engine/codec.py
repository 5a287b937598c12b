"""Tensors between processes as dtype, shape and bytes: the engine core's socket and the Ray calls that carry a VERIFY.

    data = dumps(message)                      # pickle, every CPU tensor inside in the fast form
    message = pickle.loads(data)               # a plain unpickler reads it back (the rebuilding function is named)
    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_bytes, deserializer=tensor_from_bytes)

Torch's own pickling goes through its storage protocol: ~200 us to write and ~250 us to read a VERIFY's three small
tensors, on the loop of whatever reads them. This form costs ~15 us each way. A tensor it does not take (on an
accelerator, with a gradient, sparse, quantized, a conjugate or negative view, a subclass) keeps torch's own pickle,
so that it comes back as it went. Used by `ciar.engine.process` (the engine core's frames) and by
`services.verifier_client.fast_tensors` (Ray handle calls).
"""

from __future__ import annotations

import copyreg
import io
import pickle

__all__ = ["dumps", "tensor_from_bytes", "tensor_to_bytes"]


def tensor_from_bytes(packed):
    """The tensor `tensor_to_bytes` packed."""
    if packed[0] == "torch":  # (a tensor the fast form does not take, in torch's own pickle)
        return pickle.loads(packed[1])
    import torch

    _, dtype, shape, data = packed
    if not data:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    return flat if len(shape) == 1 else flat.reshape(shape)  # (a VERIFY's ids are 1-D: no operation for them)


def tensor_to_bytes(x):
    """A CPU tensor as its dtype, shape and bytes; another tensor in torch's own pickle (see the module docstring)."""
    import torch

    if type(x) is not torch.Tensor or x.device.type != "cpu" or x.requires_grad or x.layout != torch.strided or \
            x.is_quantized or x.is_conj() or x.is_neg():
        return ("torch", pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    flat = x.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # (a single element may carry any stride, even from .contiguous())
        flat = flat.clone(memory_format=torch.contiguous_format)
    return ("raw", x.dtype, tuple(x.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


def _reduce_tensor(x):
    return tensor_from_bytes, (tensor_to_bytes(x),)


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()


def dumps(message) -> bytes:
    """`pickle.dumps(message)` (the highest protocol) with every tensor inside in the fast form."""
    import torch

    if torch.Tensor not in _Pickler.dispatch_table:
        _Pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()
