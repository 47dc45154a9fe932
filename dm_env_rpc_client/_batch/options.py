"""``BatchedEnvironment.connect``'s keywords in two groups: how to connect, what a failure does.

``ConnectionOptions`` (``credentials``, ``options``, ``insecure``, ``metadata``,
``wait_for_ready``, ``max_streams_per_connection``, ``max_response_bytes``) and
``FailurePolicy`` (``on_world_failure``, ``step_timeout``, ``restart``) hold
keywords that go together, so that one object can be made once and passed to
every batch::

    tls = dmr.ConnectionOptions(credentials=grpc.ssl_channel_credentials(), metadata=[...])
    keep_going = dmr.FailurePolicy("restart", step_timeout=10.0)
    batch = dmr.BatchedEnvironment.connect(addresses, connection=tls, failure_policy=keep_going)

The single keywords still work. ``ungroup`` turns a group back into them, and
refuses a keyword given both ways (a single keyword that is not its default,
next to a group that holds it): one of them would be silently dropped.
``regroup`` does the same the other way round, for an entry point that takes the
groups and the single keywords as ``**single`` (``MultiAgentBatch.connect``):
it gives both groups, whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import grpc

from .. import errors
from .._base import checks as _checks
from .channels import DEFAULT_STREAMS_PER_CONNECTION
from .restart import RAISE, RestartPolicy

_TWICE = (
    "{name}={value!r} is given both as a keyword and in {group}=; give it one way "
    "(drop the keyword, or leave {name} out of the {kind})."
)
_NOT_A_GROUP = "{group} is a dmr.{kind} or None, not {what}."


class ConnectionOptions(NamedTuple):
    """How a batch's streams connect (``BatchedEnvironment.connect(connection=...)``).

    Attributes:
      credentials: channel credentials for TLS (as for ``dmr.connect``).
      options: extra gRPC channel options.
      insecure: allow plaintext to a remote host.
      metadata: gRPC metadata for every stream.
      wait_for_ready: wait for servers still starting, as for ``dmr.connect``.
      max_streams_per_connection: the most worlds on one HTTP/2 connection; more
        get more connections (see ``_batch.channels``).
      max_response_bytes: the largest answer a world takes, in bytes (None: any).
    """

    credentials: grpc.ChannelCredentials | None = None
    options: Sequence[tuple[str, Any]] | None = None
    insecure: bool = False
    metadata: Sequence[tuple[str, str]] | None = None
    wait_for_ready: bool = False
    max_streams_per_connection: int | None = DEFAULT_STREAMS_PER_CONNECTION
    max_response_bytes: int | None = None


class FailurePolicy(NamedTuple):
    """What a world's failure does (``BatchedEnvironment.connect(failure_policy=...)``).

    Attributes:
      on_world_failure: ``"raise"`` or ``"restart"`` (see ``dmr.BatchedEnvironment``).
      step_timeout: a world with steps in flight and no response for this many
        seconds has failed (None: never).
      restart: the bounds of a restart (``RestartPolicy()`` by default).
    """

    on_world_failure: str = RAISE
    step_timeout: float | None = 30.0
    restart: RestartPolicy | None = None


def ungroup(
    connection: ConnectionOptions | None,
    failure_policy: FailurePolicy | None,
    **keywords: Any,
) -> dict[str, Any]:
    """The single keywords of both groups, from the groups where given.

    Args:
      connection: the connection's group, or None.
      failure_policy: the failure policy's group, or None.
      **keywords: every keyword of both groups, as given to ``connect``.

    Returns:
      ``keywords`` with the fields of the groups given.

    Raises:
      ArgumentTypeError: a group of the wrong type.
      ArgumentValueError: a keyword given both as a keyword and in its group.
    """
    merged = dict(keywords)
    for name, group, kind in (
        ("connection", connection, ConnectionOptions),
        ("failure_policy", failure_policy, FailurePolicy),
    ):
        if group is None:
            continue
        if not isinstance(group, kind):
            raise errors.ArgumentTypeError(
                _NOT_A_GROUP.format(group=name, kind=kind.__name__, what=_checks.kind(group))
            )
        for field in kind._fields:
            value, default = keywords[field], kind._field_defaults[field]
            if value is not default and value != default:
                raise errors.ArgumentValueError(
                    _TWICE.format(name=field, value=value, group=name, kind=kind.__name__)
                )
            merged[field] = getattr(group, field)
    return merged


_FIELDS = (*ConnectionOptions._fields, *FailurePolicy._fields)


def regroup(
    caller: str,
    connection: ConnectionOptions | None,
    failure_policy: FailurePolicy | None,
    single: Mapping[str, Any],
    known: Sequence[str] = (),
) -> tuple[ConnectionOptions, FailurePolicy]:
    """Both groups, from the groups given and the single keywords of ``single``.

    Args:
      caller: the entry point, for the errors (e.g. ``"MultiAgentBatch.connect"``).
      connection: the connection's group, or None.
      failure_policy: the failure policy's group, or None.
      single: single keywords of either group (``step_timeout=10.0``), as given.
      known: the caller's other keywords, to suggest one for a misspelled keyword.

    Returns:
      ``(ConnectionOptions, FailurePolicy)``, defaults where nothing was given.

    Raises:
      ArgumentTypeError: a keyword of neither group (with the closest known one), or a
        group of the wrong type.
      ArgumentValueError: a keyword given both as a keyword and in its group.
    """
    for name in single:
        if name not in _FIELDS:
            raise _checks.unknown_keyword(caller, name, [*known, *_FIELDS])
    keywords = {**ConnectionOptions()._asdict(), **FailurePolicy()._asdict(), **single}
    merged = ungroup(connection, failure_policy, **keywords)
    return (
        ConnectionOptions(**{field: merged[field] for field in ConnectionOptions._fields}),
        FailurePolicy(**{field: merged[field] for field in FailurePolicy._fields}),
    )
