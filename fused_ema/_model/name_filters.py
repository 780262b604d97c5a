"""Name filters of ModelEma (copy_names, ignore_names and ema-pytorch's spellings): exact names,
module names or fnmatch globs, validated once and matched against the EMA's names."""

from __future__ import annotations

import fnmatch
import glob
import re


def check_name_patterns(what: str, value) -> tuple[str, ...]:
    """Name patterns (an exact name, a module name, or an fnmatch glob), validated: None, one
    string, or an iterable of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(
            f"{what} must be a name, a module name or a glob, or a list of them; got "
            f"{type(value).__name__} {value!r}"
        ) from None
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(
                f"{what} must hold non-empty strings (names, module names or globs), got "
                f"{type(item).__name__} {item!r}"
            )
    return tuple(dict.fromkeys(items))


class NameFilter:
    """Matches tensor names against patterns: a name equal to a pattern, under a module of that
    name ("head" matches "head.weight"), or matched by it as an fnmatch glob (*, ?, [...])."""

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = patterns
        self._exact = set(patterns)
        globs = [fnmatch.translate(p) for p in patterns if glob.has_magic(p)]
        self._glob = re.compile("|".join(globs)) if globs else None

    def __call__(self, name: str) -> bool:
        if self._glob is not None and self._glob.match(name):
            return True
        parts = name.split(".")  # the name itself, or a module holding it
        return any(".".join(parts[:k]) in self._exact for k in range(1, len(parts) + 1))

    def matches_any(self, names) -> bool:
        return bool(self.patterns) and any(self(n) for n in names)

    def unused(self, names) -> list[str]:
        """The patterns that match none of `names`."""
        return [p for p in self.patterns if not any(map(NameFilter((p,)), names))]


def name_filters(copy_names, ignore_names, no_ema_names, ignore_prefixes) -> tuple[tuple, tuple]:
    """ModelEma's (copy, ignore) name patterns, with ema-pytorch's spellings folded in:
    param_or_buffer_names_no_ema copies, ignore_startswith_names ignores by string prefix."""
    copy = check_name_patterns("copy_names", copy_names)
    copy += check_name_patterns("param_or_buffer_names_no_ema", no_ema_names)
    ignore = check_name_patterns("ignore_names", ignore_names)
    prefixes = check_name_patterns("ignore_startswith_names", ignore_prefixes)
    ignore += tuple(glob.escape(p) + "*" for p in prefixes)  # plain string prefixes
    return tuple(dict.fromkeys(copy)), tuple(dict.fromkeys(ignore))
