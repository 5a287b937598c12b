"""A session as its device knows it: enough to re-create it on a verifier (RESUME) after the verifier lost it or a
reply was lost in flight. One definition for both transports: `ciar_device.connection.DeviceConnection` (a real
socket) and `ciar.sim.recovery.RecoveringClient` (the in-cluster devices' Ray handles).

Requests and replies may carry numpy arrays or torch tensors; the history keeps numpy arrays in the dtype they were
sent in (a resumed session must see exactly the values the lost one saw), and gives them back through `array`
(e.g. `torch.from_numpy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ciar_device.wire import InjectedFeatures, OpenRequest, VerifyReply, VerifyRequest


def _numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor (read without importing torch)
        a = a.detach().cpu().numpy()
    return np.array(a, copy=True)


def _ids(a) -> list[int]:
    return [int(t) for t in _numpy(a).reshape(-1)] if a is not None else []


@dataclass
class SessionHistory:
    request: OpenRequest  # want_caption=False: what RESUME sends
    tokens: list[int]  # committed tokens as the cloud counts them
    positions: list[int] = field(default_factory=list)  # history indices sent with interval features
    hidden: list[np.ndarray] = field(default_factory=list)  # [m_i, d_device] per verify that sent features
    features: list[np.ndarray] = field(default_factory=list)  # [m_i, F]

    @classmethod
    def resumed(cls, request: OpenRequest, history, injected: InjectedFeatures | None) -> "SessionHistory":
        """The history a RESUME re-created the session from."""
        h = cls(request, _ids(history))
        if injected is not None and len(_ids(injected.positions)):
            h.positions = _ids(injected.positions)
            h.hidden, h.features = [_numpy(injected.device_hidden)], [_numpy(injected.features)]
        return h

    def commit(self, request: VerifyRequest, reply: VerifyReply) -> None:
        """Record what a verification committed: the pending tokens, the accepted drafts, the cloud's next token and
        burst (and the interval features the pending tokens carried)."""
        new = _ids(request.new_tokens)
        if request.device_hidden is not None and request.features is not None and new:
            self.positions.extend(range(len(self.tokens), len(self.tokens) + len(new)))
            self.hidden.append(_numpy(request.device_hidden))
            self.features.append(_numpy(request.features))
        burst = _ids(reply.burst_tokens) if reply.num_burst else []
        self.tokens.extend(new + _ids(request.draft_tokens)[:reply.num_accepted] + [int(reply.next_token)] + burst)

    def history(self, array: Callable[[np.ndarray], Any] | None = None):
        """The committed tokens as an int64 array (through `array` if given)."""
        h = np.array(self.tokens, np.int64)
        return array(h) if array is not None else h

    def injected(self, array: Callable[[np.ndarray], Any] | None = None) -> InjectedFeatures | None:
        """The interval features sent so far, keyed by history position (None if none were sent)."""
        if not self.positions:
            return None
        f = array or (lambda a: a)
        return InjectedFeatures(f(np.array(self.positions, np.int64)), f(np.concatenate(self.hidden)),
                                f(np.concatenate(self.features)))
