"""ciar.engine.codec: tensors as dtype, shape and bytes, and what keeps torch's own pickle."""

import pickle

import torch

from ciar.engine.codec import dumps, tensor_from_bytes, tensor_to_bytes


def test_tensors_cross_the_socket_as_they_were():
    """The engine core's frames (dtype, shape, bytes): every dtype the calls carry, empty, 0-d, strided."""
    for x in [torch.randn(3, 4), torch.zeros(0, dtype=torch.long), torch.tensor(5), torch.randn(2, 3).half(),
              torch.randn(4).bfloat16(), torch.tensor([True, False]), torch.randn(4, 4).t(),
              torch.as_strided(torch.arange(3), (1,), (0,)),  # one element, stride 0 (what .contiguous() keeps)
              torch.as_strided(torch.arange(3), (0, 2), (0, 0)), torch.zeros(1, 3)[:, :1].expand(4, 1)]:
        y = pickle.loads(dumps(x))
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x) and y.is_contiguous()
    # what the fast form does not take keeps torch's own pickle: a gradient, a subclass, a sparse or conjugate view
    for x in [torch.randn(2, requires_grad=True), torch.nn.Parameter(torch.randn(2)), torch.randn(3, 3).to_sparse(),
              torch.randn(3, dtype=torch.cfloat).conj()]:
        y = pickle.loads(dumps(x))
        assert type(y) is type(x) and y.requires_grad == x.requires_grad and y.layout == x.layout
        assert torch.equal(y.detach().to_dense().resolve_conj(), x.detach().to_dense().resolve_conj())


def test_the_ray_serializer_pair_gives_back_each_tensor():
    """The pair `services.verifier_client.fast_tensors` registers with Ray: a raw CPU tensor and one in torch's
    pickle both come back equal (Ray calls the two functions itself, without pickling the tensor)."""
    for x in [torch.randint(0, 1024, (7,)), torch.rand(4, 1024).half(), torch.randn(2, requires_grad=True)]:
        packed = tensor_to_bytes(x)
        assert packed[0] == ("torch" if x.requires_grad else "raw")
        y = tensor_from_bytes(pickle.loads(pickle.dumps(packed)))
        assert y.dtype == x.dtype and torch.equal(y.detach(), x.detach()) and y.requires_grad == x.requires_grad
