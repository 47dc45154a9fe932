"""The world helpers' check of the keywords they pass on to the adaptor.

``join_world``, ``create_and_join_world`` and their asyncio twins pass the keywords
they do not take themselves to the adaptor; ``check_adaptor_kwargs`` refuses an
unknown one before anything is sent, naming the closest known keyword.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from .. import errors
from .._base import checks as _checks

_UNKNOWN_KEYWORD = (
    "{caller}() got an unexpected keyword argument {name!r}{suggestion}. "
    "{own} the DmEnvAdaptor keywords: {known}."
)
_OWN = "Its own arguments are {own}; it also takes"
# The helpers' own arguments (async ones too), suggested for a misspelled keyword.
_OWN_ARGUMENTS = {
    "join_world": ("connection", "world_name", "join_world_settings"),
    "create_and_join_world": ("connection", "create_world_settings", "join_world_settings"),
}
# What the helpers set themselves, never from adaptor_kwargs.
_HELPER_SET = ("connection", "specs", "world_name", "destroy_on_close")


def check_adaptor_kwargs(caller: str, adaptor_kwargs: Mapping[str, Any], adaptor: type) -> None:
    """Refuses keywords ``adaptor`` does not take, before anything is sent.

    Args:
      caller: the world helper's name, for the message; its own arguments are
        suggested too (``create_world_setting`` is a misspelled ``create_world_settings``).
      adaptor_kwargs: the keywords given for the adaptor.
      adaptor: the adaptor class they go to.

    Raises:
      ArgumentTypeError: naming the keyword, the closest known one, and all of them.
    """
    known = [name for name in inspect.signature(adaptor).parameters if name not in _HELPER_SET]
    own = _OWN_ARGUMENTS.get(caller.removesuffix("_async"), ())
    if "timeout" in adaptor_kwargs:
        _checks.check_seconds(adaptor_kwargs["timeout"])
    for name in adaptor_kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, [*own, *known], n=1)
            raise errors.ArgumentTypeError(
                _UNKNOWN_KEYWORD.format(
                    caller=caller,
                    name=name,
                    suggestion=f" (did you mean {close[0]!r}?)" if close else "",
                    own=_OWN.format(own=", ".join(own)) if own else "It takes",
                    known=", ".join(known),
                )
            )
