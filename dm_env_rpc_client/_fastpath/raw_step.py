"""A batch's step answers kept as their bytes: the state read, nothing parsed, on the loop.

A batch's loop thread needs one thing of each step's answer: its state (for the
world's step-type state machine, in answer order). The observations are decoded
later, on the thread that calls ``recv``, a batch at a time, from the answers'
bytes (``_fastpath.layout``). Parsing each answer into a protobuf message on the
loop, only for that thread to serialize it again for the layout, was two
thirds of the loop's own work per step.

``read_answer(data, layout)`` gives a ``RawStep`` for an ``EnvironmentResponse``
that holds a step: the ``StepResponse``'s bytes (``body``) and its ``state``.
With a ``layout`` (learned by the batch's ``ObservationPlan`` from an answer it
checked and decoded) that ``body`` fits (``Layout.fits``: its length and every
byte outside the payloads and the state's value), the state is read from its
one byte and nothing is parsed: protobuf parses bytes deterministically, so
such a body parses to the learned answer's fields with this state, and no
other state field can hide in it. Any other answer (no layout yet, another
length or structure, a state of more than one byte, an error, another payload,
is parsed as before (``messages.unwrap``; a large answer is ``read_step``'s, walked): the
same result and the same errors, with its bytes kept as ``body`` where they are
a step's, so the plan can learn the layout from the bytes the server sends.

A ``RawStep`` answers what the batch and the plan read of a ``StepResponse``:
``state``, ``observations`` (parsed on first use) and ``SerializeToString()``
(its bytes).
"""

from __future__ import annotations

from typing import Any

from .. import messages
from .._proto import dm_env_rpc_pb2
from .layout import Layout
from .wire_step import LARGE, read_step

_STEP_TAG = 3 << 3 | 2  # EnvironmentResponse.step


class RawStep:
    """A ``StepResponse`` as its bytes (``body``) and its ``state``; parsed only if asked.

    Args:
      body: the serialized StepResponse (None when only ``message`` is known).
      state: its state.
      message: the parsed StepResponse, if it was parsed.
    """

    __slots__ = ("_message", "body", "state")

    def __init__(self, body: bytes | None, state: int, message: Any = None) -> None:
        self.body, self.state, self._message = body, state, message

    def message(self) -> Any:
        """The parsed ``StepResponse`` (parsed on the first call)."""
        if self._message is None:
            assert self.body is not None  # one of the two is always known
            self._message = dm_env_rpc_pb2.StepResponse.FromString(self.body)
        return self._message

    @property
    def observations(self) -> Any:
        """The parsed response's observations map."""
        return self.message().observations

    def SerializeToString(self) -> bytes:  # the protobuf Message method it stands in for
        """The StepResponse's bytes: as the server sent them, else serialized."""
        if self.body is None:
            return self.message().SerializeToString()  # type: ignore[no-any-return]
        return self.body


def _body_start(data: bytes) -> int:
    """Where the StepResponse starts in ``data`` if ``data`` is one step field and nothing
    else (a tag, a length of one or two bytes, that many bytes), else 0."""
    if len(data) < 3 or data[0] != _STEP_TAG:
        return 0
    length = data[1]
    start = 2
    if length >= 0x80:
        if data[2] >= 0x80:
            return 0
        length = (length & 0x7F) | data[2] << 7
        start = 3
    return start if len(data) - start == length else 0


def read_answer(data: bytes, layout: Layout | None) -> Any:
    """A step's ``EnvironmentResponse`` bytes as a ``RawStep`` (a large one: ``read_step``'s).

    Args:
      data: the response's bytes.
      layout: the batch plan's learned layout, if any (see the module docs).

    Raises:
      DmEnvRpcError: the server answered with an error.
      ProtocolError: the response is not a step response.
    """
    if len(data) >= LARGE:
        return read_step(data)
    start = _body_start(data)
    if start and layout is not None and layout.state_at == 1:
        state = data[start + 1]
        if state < 0x80 and layout.fits(data, start):
            return RawStep(data[start:], state)
    response = messages.unwrap(data, "step")
    return RawStep(data[start:] if start else None, response.state, response)
