"""Checks a dm_env_rpc server against the protocol and reports each rule it keeps or breaks.

::

    from dm_env_rpc_client import conformance

    report = conformance.check_server("127.0.0.1:50051", timeout=5)
    print(report.text())            # one line per rule: PASS, FAIL or SKIP, and why
    assert report.conforms          # no rule failed

Each ``Finding`` names a rule by a stable id (``RULES`` holds the sentence of
each) and says what was seen. The checks drive the server only through the
protocol, over streams of their own (a failure on one stream does not spoil the
others), with random valid actions drawn from the world's specs:

- ``connect``: the server accepts a stream.
- ``lifecycle.*``: create, join, step, reset, reset world, leave, destroy.
- ``specs.*``: names unique, dtypes valid, shapes valid, bounds consistent.
- ``step.*``: the requested observations come back, of their specs' dtypes and
  shapes; the first step after joining ignores its actions.
- ``pipeline.order``: requests sent without waiting are answered in order.
- ``errors.*``: bad requests (step or reset before join, an unknown action UID,
  an action of the wrong dtype, an unknown world) are answered with an error
  status, and the stream still answers afterwards.
- ``multi-client.concurrent``: two clients at once are both served, or the
  second is refused with an error (then the rule is skipped), never left hanging.
- ``multi-agent.*``: two agents join one world (their steps sent together), a
  ResetWorld from a third stream makes both agents' next steps INTERRUPTED, a
  leave lets the other agent go on, and a DestroyWorld from a joined stream is
  refused. A server that refuses the second agent serves one agent per world:
  the group is skipped, with the refusal as the reason.
- ``episodes.first-after-last``: the step after a TERMINATED or INTERRUPTED one
  answers RUNNING (a new sequence begins).
- ``latency.step``: round trips of single steps, p50 and p99 (``ConformanceReport.latency``).

Every request waits at most ``timeout`` seconds: a server that does not answer
is a failed rule, never a hung check. A rule that could not be checked (its
world could not be made, the world has no action to send a wrong dtype to, no
episode ended within ``episode_steps``) is ``SKIP`` with the reason; skips do
not make a server non-conforming.

The command line runs the same: ``dm-env-rpc-client check ADDRESS [--json]``,
exit code 0 when the server conforms and 1 when it does not.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, cast

from ._base import checks as _checks
from ._tools import conformance_checks as _conformance
from ._tools.conformance_probe import RULES
from .connection import connect

__all__ = ["RULES", "ConformanceReport", "Finding", "check_server"]

Status = Literal["pass", "fail", "skip"]

DEFAULT_CHECK_TIMEOUT = 5.0  # seconds any one request may take


class Finding(NamedTuple):
    """The verdict on one rule.

    Attributes:
      rule: the rule's stable id, a key of ``RULES`` (e.g. ``"errors.unknown-uid"``).
      status: ``"pass"``, ``"fail"`` or ``"skip"`` (could not be checked).
      detail: what was seen: for a failure, what the server did instead.
    """

    rule: str
    status: Status
    detail: str

    @property
    def sentence(self) -> str:
        """The rule, in a sentence."""
        return RULES[self.rule]


@dataclasses.dataclass
class ConformanceReport:
    """The findings of ``check_server`` on one server, one per rule, in ``RULES`` order.

    Attributes:
      address: the server checked.
      findings: one ``Finding`` per rule.
      latency: ``{"p50_ms": ..., "p99_ms": ..., "steps": n}`` of single-step round trips,
        or empty if they could not be measured.
    """

    address: str
    findings: list[Finding]
    latency: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def conforms(self) -> bool:
        """True when no rule failed (skipped rules do not count against the server)."""
        return not self.failures

    @property
    def failures(self) -> list[Finding]:
        """The findings of the rules the server broke."""
        return [finding for finding in self.findings if finding.status == "fail"]

    def by_rule(self) -> dict[str, Finding]:
        """The findings keyed by rule id."""
        return {finding.rule: finding for finding in self.findings}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form: address, conforms, latency and the findings with their sentences."""
        return {
            "address": self.address,
            "conforms": self.conforms,
            "latency": dict(self.latency),
            "findings": [
                {"rule": f.rule, "status": f.status, "rule_text": f.sentence, "detail": f.detail}
                for f in self.findings
            ],
        }

    def to_json(self) -> str:
        """``to_dict`` as one JSON object."""
        return json.dumps(self.to_dict(), indent=2)

    def text(self) -> str:
        """A report for people: one line per rule, then the verdict."""
        width = max(len(rule) for rule in RULES)
        lines = [f"Conformance of {self.address} to dm_env_rpc v1"]
        for finding in self.findings:
            lines.append(
                f"  {finding.status.upper():4}  {finding.rule:{width}}  {finding.sentence}"
            )
            if finding.detail:
                lines.append(f"        {'':{width}}  {finding.detail}")
        counts = {status: 0 for status in ("pass", "fail", "skip")}
        for finding in self.findings:
            counts[finding.status] += 1
        verdict = "conforms" if self.conforms else "does NOT conform"
        lines.append(
            f"{self.address} {verdict}: {counts['pass']} passed, {counts['fail']} failed, "
            f"{counts['skip']} skipped."
        )
        return "\n".join(lines)


def check_server(
    address: str,
    *,
    timeout: float = DEFAULT_CHECK_TIMEOUT,
    create_world_settings: Mapping[str, Any] | None = None,
    join_world_settings: Mapping[str, Any] | None = None,
    latency_steps: int = 200,
    episode_steps: int = 1000,
    seed: int = 0,
    world_name: str | None = None,
    **connect_kwargs: Any,
) -> ConformanceReport:
    """Checks the dm_env_rpc server at ``address`` against the protocol.

    Args:
      address: ``host:port`` (or any gRPC target ``dmr.connect`` takes).
      timeout: seconds any one request (and connecting) may take; a server that
        does not answer within it fails the rule being checked.
      create_world_settings: CreateWorld settings for the worlds the checks make
        (values as ``dmr.create_world`` takes them: numbers, strings, arrays).
      join_world_settings: JoinWorld settings likewise.
      latency_steps: single steps timed for ``latency.step``.
      episode_steps: steps to wait for an episode to end for
        ``episodes.first-after-last`` (skipped if none ends).
      seed: seeds the random actions.
      world_name: join this existing world instead of creating worlds (for servers
        with a fixed world); ``lifecycle.create`` and ``lifecycle.destroy`` are then
        skipped, and the world is left but not destroyed.
      **connect_kwargs: passed to ``dmr.connect`` (``credentials``, ``insecure``,
        ``options``, ``metadata``).

    Returns:
      A ``ConformanceReport`` with one ``Finding`` per rule of ``RULES``.

    Raises:
      ArgumentValueError: a bad address, ``timeout`` not above 0, ``latency_steps`` or
        ``episode_steps`` below 1.
      ArgumentTypeError: a keyword neither this nor ``dmr.connect`` takes.
    """
    _checks.check_address(address)
    _checks.check_seconds(timeout, allow_none=False)
    _checks.check_count(latency_steps, "latency_steps")
    _checks.check_count(episode_steps, "episode_steps")
    takes = inspect.signature(connect).parameters
    for name in connect_kwargs:
        if name not in takes:
            known = [*inspect.signature(check_server).parameters, *takes]
            raise _checks.unknown_keyword("check_server", name, known)
    probe = _conformance.Probe(
        address,
        timeout=timeout,
        create_settings=dict(create_world_settings or {}),
        join_settings=dict(join_world_settings or {}),
        seed=seed,
        connect_kwargs=connect_kwargs,
        world_name=world_name,
    )
    verdicts, latency = _conformance.run_checks(probe, latency_steps, episode_steps)
    findings = [Finding(rule, cast(Status, verdicts[rule][0]), verdicts[rule][1]) for rule in RULES]
    return ConformanceReport(address, findings, latency)
