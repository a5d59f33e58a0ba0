"""The one JSON form a receipt's entries are hashed, written and signed in, and the error every part
of a receipt raises."""

from __future__ import annotations

import json

from toolkit.base.errors import FtError


class ReceiptError(FtError):
    """A receipt that cannot be appended to, read or sealed."""


def canonical(value: object) -> bytes:
    """The one JSON form entries are hashed, written and signed in."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
