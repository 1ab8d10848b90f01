"""Comma-separated options as lists, checked where they enter: at least one item, none
empty, and none twice however spelled (``16,16.0``, ``8,08``: a repeat would repeat rows),
except the lists that go by position (shares per GPU, rates per depth)."""

from __future__ import annotations

from moesim.errors import MoesimError
from moesim.policy import Policy, get_policy


def split(value: str, option: str, repeats: bool = False) -> list[str]:
    """A comma-separated option as a list: at least one item, none empty, none twice (a
    repeated item would repeat rows, an empty one silently mean a default) unless
    ``repeats`` (a list by position, such as shares or per-depth rates)."""
    items = [v.strip() for v in value.split(",")]
    if not any(items):
        raise MoesimError(f"{option}: give at least one value")
    if not all(items):
        raise MoesimError(f"{option} {value!r}: an empty item (two commas, or one at an end)")
    if not repeats:
        _once([v.lower() for v in items], items, option)
    return items


def _once(keys: list, items: list[str], option: str) -> None:
    """Refuse an item whose key (its value, however spelled) an earlier item has."""
    for i, k in enumerate(keys):
        if k in keys[:i]:
            first = items[keys.index(k)]
            same = "" if items[i].lower() == first.lower() else f" (the same as {first!r})"
            raise MoesimError(f"{option}: {items[i]!r} appears twice{same}")


def floats(value: str, option: str, repeats: bool = False) -> list[float]:
    """Comma-separated numbers; a value given twice (``16,16.0``) is refused unless ``repeats``."""
    items = split(value, option, repeats=True)
    try:
        out = [float(v) for v in items]
    except ValueError:
        raise MoesimError(f"{option}: {value!r} is not a comma-separated list of numbers") from None
    if not repeats:
        _once(out, items, option)
    return out


def ints(value: str, option: str) -> list[int]:
    """A comma-separated list of whole numbers (one line, exit 2, on anything else); a value
    given twice, however spelled (``8,08``), is refused."""
    items = split(value, option)
    try:
        out = [int(v) for v in items]
    except ValueError:
        raise MoesimError(f"{option}: {value!r} is not a comma-separated list of whole numbers") from None
    _once(out, items, option)
    return out


def auto_or(value: str, option: str, kind: type) -> list:
    """A comma-separated list of ``auto`` and numbers of ``kind``, none twice (``8,8.0``)."""
    items = split(value, option)
    try:
        out = [v if v == "auto" else kind(v) for v in items]
    except ValueError:
        raise MoesimError(f"{option}: {value!r} is not a comma-separated list of auto and numbers") from None
    _once(out, items, option)
    return out


def policy_objects(value: str, option: str = "--policy") -> list[Policy]:
    """The policies named, resolved once here (the sweep takes the objects), none twice once
    aliases are resolved (``prefetch,prefetch-fom`` would time prefetch-fom twice); an
    unknown name is the policy table's one line."""
    items = split(value, option)
    pols = [get_policy(v) for v in items]
    _once([p.name for p in pols], items, option)
    return pols


def policies(value: str, option: str = "--policy") -> list[str]:
    """Policy names as given, checked as :func:`policy_objects` checks them."""
    policy_objects(value, option)
    return split(value, option)
